"""Token chunks of the Hadamard Q/K transforms: forward and input-gradient time per chunk size.

    python pretrain/research/benchmarks/hadamard_chunks.py [--d-model 512] [--tokens 2048]
        [--chunks 2048,1024,512,256,128] [--repeats 30] [--json OUT]

What `_HadamardQKV` runs for Q and K of one layer (ora_megatron.hadamard.HadamardRows: two
transforms of order d, every column taken in a random order): `columns` (the two contractions
and the gather into the output) and `columns_transposed` (the gather of the gradient, the adjoint
contractions), on [tokens, d] fp32 inputs. The chunk sizes take turns within every repeat, so a
drifting machine load hits all alike; medians, and their ratio to one chunk of all tokens. The
default chunk (`HadamardRows.chunk_tokens`, from CPU_CHUNK_BYTES) is marked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ora_megatron.hadamard import HadamardRows


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(d: int, tokens: int, chunks: list[int], repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    kernel = HadamardRows([torch.randint(0, 2, (d,), generator=generator).float() * 2 - 1 for _ in range(2)])
    default_chunk = kernel.chunk_tokens
    columns = torch.cat([torch.randperm(d, generator=generator) for _ in range(2)])
    block, offset = kernel.position(torch.arange(2).repeat_interleave(d), columns)
    index, mask = kernel.gather_map(block, offset, torch.arange(2 * d))
    x, grad = torch.randn(tokens, d, generator=generator), torch.randn(tokens, 2 * d, generator=generator)
    out, grad_x = torch.empty(tokens, 2 * d), torch.empty(tokens, d)
    times = {chunk: ([], []) for chunk in chunks}
    for _ in range(repeats + 3):  # the first 3 rounds warm up
        for chunk in chunks:
            kernel.chunk_tokens = chunk
            times[chunk][0].append(timed(lambda: kernel.columns(x, block, offset, out)))
            times[chunk][1].append(timed(lambda: kernel.columns_transposed(grad, index, mask, grad_x)))
    whole = [statistics.median(t[3:]) for t in times[max(chunks)]]
    rows = []
    for chunk in chunks:
        forward, backward = (statistics.median(t[3:]) for t in times[chunk])
        rows.append({"chunk_tokens": chunk, "default": chunk == default_chunk, "forward_ms": forward * 1e3,
                     "input_grad_ms": backward * 1e3, "forward_speedup": whole[0] / forward,
                     "input_grad_speedup": whole[1] / backward})
    return {"d_model": d, "tokens": tokens, "repeats": repeats, "torch_threads": torch.get_num_threads(),
            "default_chunk_tokens": default_chunk, "rows": rows}


def table(report: dict) -> str:
    lines = [f"d {report['d_model']}, {report['tokens']} tokens, medians of {report['repeats']}; "
             f"speed-up against one chunk of all tokens",
             f"{'chunk':>8}{'forward ms':>12}{'×':>7}{'input grad ms':>15}{'×':>7}"]
    for r in report["rows"]:
        mark = " (default)" if r["default"] else ""
        lines.append(f"{r['chunk_tokens']:>8}{r['forward_ms']:>12.2f}{r['forward_speedup']:>7.2f}"
                     f"{r['input_grad_ms']:>15.2f}{r['input_grad_speedup']:>7.2f}{mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of one micro-batch (seq × batch)")
    parser.add_argument("--chunks", default="2048,1024,512,256,128", help="comma-separated chunk sizes in tokens")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    chunks = sorted({min(int(c), args.tokens) for c in args.chunks.split(",") if c} | {args.tokens}, reverse=True)
    report = run(args.d_model, args.tokens, chunks, args.repeats)
    report["command"] = ["python", "pretrain/research/benchmarks/hadamard_chunks.py",
                         *(argv if argv is not None else sys.argv[1:])]
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
