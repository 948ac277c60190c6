"""Measure build_shards throughput (docs/s, MB/s, tokens/s) against the number of workers.

    python -m data_tools.benchmark_throughput --input PATH... --tokenizer MODEL
        [--workers 1 2 4] [--repeat R] [--out results.json] [any other build_shards option]

Each worker count runs R complete builds (read, parse, tokenize, write shards, manifest) into
temporary directories removed afterwards, and keeps the fastest. MB/s counts the UTF-8 bytes of
the documents' text, input MB/s the bytes of the input files as stored (compressed or not).
"""

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile

from data_tools import build_shards
from data_tools.build_options import BuildOptions


def measure(options: BuildOptions, workers: int) -> dict:
    """One complete build with `workers` processes into a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="benchmark_shards_") as out_dir:
        run_options = dataclasses.replace(options, output_dir=out_dir, workers=workers, quiet=True)
        stats = build_shards.build(run_options)
    seconds = stats["seconds"]
    return {
        "workers": workers,
        "seconds": round(seconds, 3),
        "documents": stats["documents_tokenized"],
        "tokens": stats["tokens_tokenized"],
        "text_bytes": stats["text_bytes_tokenized"],
        "docs_per_s": round(stats["documents_tokenized"] / seconds, 1),
        "text_mb_per_s": round(stats["text_bytes_tokenized"] / seconds / 1e6, 3),
        "input_mb_per_s": round(stats["input_bytes"] / seconds / 1e6, 3),
        "tokens_per_s": round(stats["tokens_tokenized"] / seconds),
    }


def table(results: list[dict]) -> str:
    header = ("workers", "seconds", "docs/s", "MB/s", "in MB/s", "tokens/s")
    lines = ["{:>7} {:>8} {:>10} {:>8} {:>8} {:>12}".format(*header)]
    lines += [
        f"{r['workers']:>7} {r['seconds']:>8.2f} {r['docs_per_s']:>10,.0f} "
        f"{r['text_mb_per_s']:>8.2f} {r['input_mb_per_s']:>8.2f} {r['tokens_per_s']:>12,}"
        for r in results
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m data_tools.benchmark_throughput", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--input", nargs="+", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per worker count; the fastest is kept")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args, build_options = parser.parse_known_args(argv)
    # build_shards' command line checks the forwarded options; measure sets the output directory
    options = build_shards.parse_args(
        ["--input", *args.input, "--tokenizer", args.tokenizer, "--output-dir", os.devnull,
         *build_options]
    )
    results = []
    for workers in args.workers:
        runs = [measure(options, workers) for _ in range(args.repeat)]
        results.append(min(runs, key=lambda run: run["seconds"]))
        print(table(results[-1:]).splitlines()[-1], file=sys.stderr)
    report = {
        "inputs": args.input,
        "tokenizer": os.path.abspath(args.tokenizer),
        "build_options": build_options,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "results": results,
    }
    print(table(results))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")


if __name__ == "__main__":
    main()
