"""Read a build_shards output back with megatron-core and check it against its manifest.

    python -m data_tools.inspect_shards OUT [--prefix PREFIX] [--document I] [--chars N] [--verify]

Prints per dataset prefix its split, source, documents, tokens and blend weight as loaded by
megatron-core's IndexedDataset (a mismatch with the manifest is flagged and makes the exit status
1; files of other byte sizes or document counts than recorded, e.g. truncated, are flagged without
being read), the skipped-record counts, and decodes one document with the manifest's tokenizer.
--verify also rereads every file and compares its sha256 with the manifest.
"""

import argparse
import os
import sys
import warnings

import sentencepiece

from data_tools.manifest import load_manifest, manifest_path
from data_tools.shard_writer import sha256_file, shard_file_problems

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    get_bin_path,
    get_idx_path,
)


def dataset_problems(root: str, entry: dict, eod_id: int, verify: bool) -> list[str]:
    """How a dataset on disk differs from its manifest entry (empty when it matches). Files of
    other sizes or document counts than recorded (truncated, replaced) are reported without
    reading them: megatron-core would read past their end."""
    path = os.path.join(root, entry["prefix"])
    problems = shard_file_problems(path, entry["bin_bytes"], entry["idx_bytes"], entry["documents"])
    if problems:
        return problems
    dataset = IndexedDataset(path)
    documents = len(dataset.document_indices) - 1
    tokens = int(dataset.sequence_lengths.sum())
    if documents != entry["documents"]:
        problems.append(f"{documents} documents, manifest says {entry['documents']}")
    if tokens != entry["tokens"]:
        problems.append(f"{tokens} tokens, manifest says {entry['tokens']}")
    if documents and int(dataset[documents - 1][-1]) != eod_id:
        problems.append("last document does not end with the EOD id")
    if verify:
        for kind, file in (("bin", get_bin_path(path)), ("idx", get_idx_path(path))):
            if sha256_file(file) != entry[f"{kind}_sha256"]:
                problems.append(f"{kind} sha256 differs from the manifest")
    return problems


def decode_document(root: str, prefix: str, index: int, tokenizer_path: str, eod_id: int) -> str:
    dataset = IndexedDataset(os.path.join(root, prefix))  # must outlive the mmap-backed view
    tokens = dataset[index].tolist()
    if tokens and tokens[-1] == eod_id:
        tokens = tokens[:-1]
    return sentencepiece.SentencePieceProcessor(model_file=tokenizer_path).decode(tokens)


def inspect(path: str, prefix: str | None, document: int, chars: int, verify: bool) -> bool:
    """Print the report; True when everything matches the manifest."""
    manifest_file = manifest_path(path)
    root = os.path.dirname(os.path.abspath(manifest_file))
    manifest = load_manifest(manifest_file)
    tokenizer = manifest["tokenizer"]
    weights = {
        entry_prefix: weight
        for blend in manifest["blend"].values()
        for entry_prefix, weight in zip(blend["prefixes"], blend["weights"])
    }
    print(f"{'prefix':<40} {'split':<6} {'source':<26} {'documents':>10} {'tokens':>14} weight")
    damaged = set()
    for entry in manifest["datasets"]:
        problems = dataset_problems(root, entry, tokenizer["eod_id"], verify)
        if problems:
            damaged.add(entry["prefix"])
        print(
            f"{entry['prefix']:<40} {entry['split']:<6} {entry['source']:<26} "
            f"{entry['documents']:>10,} {entry['tokens']:>14,} {weights[entry['prefix']]:.4f}"
            + "".join(f"\n    MISMATCH: {problem}" for problem in problems)
        )
    totals, skipped = manifest["totals"], manifest["skipped"]
    print(
        f"total: {totals['documents']:,} documents, {totals['tokens']:,} tokens, "
        f"{totals['shards']} shards; skipped {skipped['total']:,} {skipped['by_reason']}"
    )
    for reason, examples in skipped["examples"].items():
        print(f"  {reason}: " + "; ".join(examples))
    if manifest["datasets"]:
        train = [entry for entry in manifest["datasets"] if entry["split"] == "train"]
        prefix = prefix or (train or manifest["datasets"])[0]["prefix"]
        if prefix in damaged:
            print(f"--- {prefix}: not decoded, its files do not match the manifest ---")
        else:
            text = decode_document(root, prefix, document, tokenizer["path"], tokenizer["eod_id"])
            more = f" ... ({len(text):,} characters)" if len(text) > chars else ""
            print(f"--- {prefix} document {document} ---\n{text[:chars]}{more}")
    return not damaged


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m data_tools.inspect_shards", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("path", help="build output directory or its manifest.json")
    parser.add_argument("--prefix", default=None, help="dataset to decode from (default: first)")
    parser.add_argument("--document", type=int, default=0, help="document index to decode")
    parser.add_argument("--chars", type=int, default=500, help="characters of it to print")
    parser.add_argument("--verify", action="store_true", help="compare sha256 of every file")
    args = parser.parse_args(argv)
    if not inspect(args.path, args.prefix, args.document, args.chars, args.verify):
        print("inspect: the datasets do not match the manifest", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
