"""Write the running Python's standard-library sources, or those of another folder, as a
SlimPajama-format corpus.

    python -m data_tools.sample_corpus --output-dir DIR [--root SRC] [--max-files N] [--max-file-bytes B]

Writes DIR/chunk1/example_train_K.jsonl.zst: one {"text": ..., "meta": {"redpajama_set_name":
"RedPajamaGithub"}} line per .py file under SRC (default: sysconfig's stdlib directory; sorted;
site-packages, test directories and caches left out), each output file holding at most B bytes of
JSON lines before compression. Real text present on every machine, no download, byte-identical on
reruns with the same sources (the stdlib: the same Python). Another folder gives a second corpus
of the same kind, e.g. an installed package's sources to fine-tune on.
"""

import argparse
import json
import os
import sys
import sysconfig

import zstandard

SOURCE_SET = "RedPajamaGithub"
SKIPPED_DIRECTORIES = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
}
ZSTD_LEVEL = 10


def python_sources(root: str, max_files: int | None = None) -> list[str]:
    """Absolute paths of the .py files under `root`, sorted by their path inside it."""
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in SKIPPED_DIRECTORIES]
        found.extend(
            os.path.relpath(os.path.join(directory, name), root)
            for name in files
            if name.endswith(".py")
        )
    found.sort()
    return [os.path.join(root, path) for path in found[:max_files]]


def jsonl_lines(paths: list[str]) -> tuple[list[bytes], int]:
    """One SlimPajama JSON line per UTF-8 source file; and how many files were not UTF-8."""
    lines, not_utf8 = [], 0
    for path in paths:
        with open(path, "rb") as handle:
            try:
                text = handle.read().decode("utf-8")
            except UnicodeDecodeError:
                not_utf8 += 1
                continue
        record = {"text": text, "meta": {"redpajama_set_name": SOURCE_SET}}
        lines.append(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
    return lines, not_utf8


def group_by_size(lines: list[bytes], max_bytes: int) -> list[list[bytes]]:
    """Consecutive groups of at most max_bytes (a longer line gets a group of its own)."""
    groups, current, size = [], [], 0
    for line in lines:
        if current and size + len(line) > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        groups.append(current)
    return groups


def write_corpus(output_dir: str, max_files: int | None, max_file_bytes: int, root: str | None = None) -> list[str]:
    """The corpus of the .py files under `root` (None: the stdlib)."""
    stdlib = root is None
    root = sysconfig.get_paths()["stdlib"] if stdlib else os.path.abspath(root)
    lines, not_utf8 = jsonl_lines(python_sources(root, max_files))
    chunk_dir = os.path.join(output_dir, "chunk1")
    os.makedirs(chunk_dir, exist_ok=True)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    written = []
    for index, group in enumerate(group_by_size(lines, max_file_bytes)):
        path = os.path.join(chunk_dir, f"example_train_{index}.jsonl.zst")
        with open(path + ".tmp", "wb") as handle:
            handle.write(compressor.compress(b"".join(group)))
        os.replace(path + ".tmp", path)
        written.append(path)
    print(
        f"sample_corpus: {len(lines):,} {'stdlib' if stdlib else 'Python'} files{'' if stdlib else ' of ' + root} "
        f"({not_utf8} not UTF-8, left out) "
        f"in {len(written)} files under {chunk_dir}",
        file=sys.stderr,
    )
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m data_tools.sample_corpus", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--root", help="the folder whose .py files are the corpus (default: this Python's stdlib)")
    parser.add_argument("--max-files", type=int, default=None, help="first N files only")
    parser.add_argument("--max-file-bytes", type=int, default=4 << 20,
                        help="JSON bytes per output file before compression")
    args = parser.parse_args(argv)
    if args.root is not None and not os.path.isdir(args.root):
        parser.error(f"--root {args.root}: not a folder")
    write_corpus(args.output_dir, args.max_files, args.max_file_bytes, args.root)


if __name__ == "__main__":
    main()
