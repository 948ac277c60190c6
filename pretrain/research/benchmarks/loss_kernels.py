"""The language-model loss alone, forward + backward, on one micro-batch: the project's fused linear
cross entropy against what a user could pick instead.

    python -m pretrain.research.benchmarks.loss_kernels [--tokens N] [--hidden H] [--vocab V]
        [--dtype bf16|fp32] [--chunk-mib 256,512] [--repeats 20] [--warmup 3] [--cases NAME,...]
        [--threads N] [--jsonl OUT] [--markdown OUT]

Every case computes the mean cross entropy of the logits hidden @ weight.T over all tokens and its
gradients w.r.t. hidden and weight, from the same inputs:
- `shipped`: ora_megatron.cross_entropy.linear_cross_entropy as the model calls it (the chunk path
  `default_chunk_path` picks on this device, named in the table);
- `eager_chunks`, `compiled_chunks`: the same with each chunk path forced; `--chunk-mib` sizes the
  compiled path's chunk budget (LOGITS_CHUNK_BYTES, one case per size);
- `whole_compiled`: the shipped call under torch.compile as a whole, as `speed.compile` wraps the
  model's `fused_loss` (the chunk loop unrolled into one graph);
- `logits_ce_eager`, `logits_ce_compiled`: the whole logits and F.cross_entropy on them in fp32,
  eager and under torch.compile (the compiled one holds [tokens × V] logits: the speed to match);
- `liger`: Liger-Kernel's LigerFusedLinearCrossEntropyLoss (Triton, GPU only), where importable;
- `torch_chunked`: torch's own F.linear_cross_entropy with LinearCrossEntropyOptions() (torch
  releases that have it; the GPU image's torch 2.11 does not). On CPU only when named in --cases:
  torch 2.13's CPU path took some 40 s a call at the CPU shape on a 2-core machine.

Defaults: on CUDA one micro-batch of the Base preset (64 × 512 tokens, h 768, V 32000, bf16); on
CPU 2 × 512 tokens, h 64, V 32000, fp32, small enough for 2 cores. After --warmup calls per case
(the first one, compilation included, reported apart as `first call`), --repeats rounds in which
every case runs once, the order reversed every other round, so that a drifting machine load hits
all alike; each call timed alone (CUDA events around it on a GPU, perf_counter on CPU): median,
min, max; beside it the median process CPU time, the figure to compare on a shared CPU machine (with
--threads 1, the work itself). Memory: on CUDA the allocator's peak during one call above what was allocated before it;
everywhere the bytes autograd saves for backward (distinct storages, the inputs' own left out). The
table's ratio is to `logits_ce_compiled`. Writes one JSON line per case (--jsonl) and the table
(--markdown); prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ora_megatron import cross_entropy
from ora_megatron.cross_entropy import default_chunk_path, linear_cross_entropy
from pretrain.research.benchmarks.outputs import publish, rerun_command

SCHEMA = "ora-loss-kernels/1"
CASES = ("shipped", "eager_chunks", "compiled_chunks", "whole_compiled", "logits_ce_eager", "logits_ce_compiled",
         "liger", "torch_chunked")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
RATIO_TO = "logits_ce_compiled"


@dataclass
class Inputs:
    hidden: torch.Tensor  # [tokens, h], a leaf that needs its gradient
    weight: torch.Tensor  # [V, h], the same
    labels: torch.Tensor  # [tokens]


@dataclass
class Case:
    name: str
    label: str  # what the table says
    loss: Callable[[Inputs], torch.Tensor]


def make_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device) -> Inputs:
    generator = torch.Generator(device=device).manual_seed(0)
    return Inputs(
        hidden=torch.randn(tokens, hidden, generator=generator, device=device).to(dtype).requires_grad_(),
        weight=(torch.randn(vocab, hidden, generator=generator, device=device) * 0.02).to(dtype).requires_grad_(),
        labels=torch.randint(0, vocab, (tokens,), generator=generator, device=device))


@contextlib.contextmanager
def chunk_budget(mib: int):
    """LOGITS_CHUNK_BYTES set to `mib` MiB for the block."""
    shipped = cross_entropy.LOGITS_CHUNK_BYTES
    cross_entropy.LOGITS_CHUNK_BYTES = mib * 2**20
    try:
        yield
    finally:
        cross_entropy.LOGITS_CHUNK_BYTES = shipped


def project_loss(inputs: Inputs, chunk_path: str | None = None) -> torch.Tensor:
    """The model's call: hidden [s, b, h] with b = 1, labels and mask [b, s]."""
    hidden = inputs.hidden.unsqueeze(1)
    labels = inputs.labels.unsqueeze(0)
    return linear_cross_entropy(hidden, inputs.weight, labels, torch.ones_like(labels, dtype=torch.float32),
                                chunk_path=chunk_path)


def project_loss_in_budget(inputs: Inputs, chunk_path: str, mib: int) -> torch.Tensor:
    with chunk_budget(mib):
        return project_loss(inputs, chunk_path)


def logits_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.t()).float(), labels)


def liger_case() -> Case | str:
    """Liger-Kernel's fused linear cross entropy, or why it cannot run here."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as error:
        return f"not importable: {error}"
    loss = LigerFusedLinearCrossEntropyLoss()
    return Case("liger", "Liger-Kernel fused linear CE", lambda x: loss(x.weight, x.hidden, x.labels))


def torch_chunked_case() -> Case | str:
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"torch {torch.__version__} has no chunked F.linear_cross_entropy"
    options = torch.nn.LinearCrossEntropyOptions()
    return Case("torch_chunked", "torch F.linear_cross_entropy, chunked",
                lambda x: F.linear_cross_entropy(x.hidden, x.weight, x.labels, options=options))


def build_cases(names: list[str], device: torch.device, chunk_mib: list[int]) -> tuple[list[Case], dict[str, str]]:
    """The cases asked for, and for those that cannot run on this machine the reason."""
    shipped_mib = cross_entropy.LOGITS_CHUNK_BYTES // 2**20
    compiled_ce = torch.compile(logits_cross_entropy)
    whole_compiled = torch.compile(project_loss)
    built: dict[str, list[Case] | Case | str] = {
        "shipped": Case("shipped", f"project, as shipped ({default_chunk_path(device)} chunks)", project_loss),
        "eager_chunks": Case("eager_chunks", "project, eager chunks",
                             functools.partial(project_loss, chunk_path="eager")),
        "compiled_chunks": [
            Case("compiled_chunks" if mib == shipped_mib else f"compiled_chunks_{mib}mib",
                 f"project, compiled chunks, {mib} MiB budget",
                 functools.partial(project_loss_in_budget, chunk_path="compiled", mib=mib)) for mib in chunk_mib],
        "whole_compiled": Case("whole_compiled", "project, the whole loss under torch.compile", whole_compiled),
        "logits_ce_eager": Case("logits_ce_eager", "logits + F.cross_entropy, eager",
                                lambda x: logits_cross_entropy(x.hidden, x.weight, x.labels)),
        "logits_ce_compiled": Case("logits_ce_compiled", "logits + F.cross_entropy, compiled",
                                   lambda x: compiled_ce(x.hidden, x.weight, x.labels)),
        "liger": liger_case() if "liger" in names else "",
        "torch_chunked": torch_chunked_case() if "torch_chunked" in names else "",
    }
    cases, unavailable = [], {}
    for name in names:
        found = built[name]
        if isinstance(found, str):
            unavailable[name] = found
        else:
            cases += found if isinstance(found, list) else [found]
    return cases, unavailable


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_backward(case: Case, inputs: Inputs) -> torch.Tensor:
    inputs.hidden.grad = inputs.weight.grad = None
    loss = case.loss(inputs)
    loss.backward()
    return loss.detach()


def timed_call(case: Case, inputs: Inputs, device: torch.device) -> tuple[float, float]:
    """(wall, process CPU time) of one forward + backward, in ms: the wall time from CUDA events around it
    on a GPU, perf_counter on CPU; the CPU time of all the process's threads (on a shared CPU machine
    steadier than the wall time; with --threads 1 the work itself)."""
    cpu_start = time.process_time()
    if device.type != "cuda":
        start = time.perf_counter()
        forward_backward(case, inputs)
        return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu_start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    forward_backward(case, inputs)
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end), (time.process_time() - cpu_start) * 1e3


def peak_bytes(case: Case, inputs: Inputs, device: torch.device) -> int | None:
    """The CUDA allocator's peak during one call above what was allocated before it (None on CPU)."""
    if device.type != "cuda":
        return None
    inputs.hidden.grad = inputs.weight.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward_backward(case, inputs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def saved_bytes(case: Case, inputs: Inputs) -> int:
    """Bytes of the distinct storages autograd keeps for backward, the inputs' own left out."""
    own = {t.untyped_storage().data_ptr() for t in (inputs.hidden, inputs.weight, inputs.labels)}
    saved = {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in own:
            saved[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        case.loss(inputs)
    return sum(saved.values())


def warm_up(cases: list[Case], inputs: Inputs, device: torch.device, calls: int) -> tuple[dict, dict]:
    """Per case: (seconds of the first call, compilation included; the loss), or the error it raised."""
    first, losses = {}, {}
    for case in cases:
        try:
            synchronize(device)
            start = time.perf_counter()
            losses[case.name] = forward_backward(case, inputs).float().item()
            first[case.name] = time.perf_counter() - start
            for _ in range(calls - 1):
                forward_backward(case, inputs)
        except Exception as error:  # noqa: BLE001 - a case that fails is reported, the others still run
            first[case.name] = f"{type(error).__name__}: {error}"[:300]
            losses.pop(case.name, None)
    return first, losses


def timed_rounds(cases: list[Case], inputs: Inputs, device: torch.device, repeats: int) -> dict[str, list]:
    """Per case, `repeats` (wall ms, process CPU ms): every case once a round, in turns, the order reversed
    every other round."""
    times = {case.name: [] for case in cases}
    for round_ in range(repeats):
        for case in cases if round_ % 2 == 0 else cases[::-1]:
            times[case.name].append(timed_call(case, inputs, device))
    return times


def run(args: argparse.Namespace, device: torch.device) -> list[dict]:
    inputs = make_inputs(args.tokens, args.hidden, args.vocab, DTYPES[args.dtype], device)
    cases, unavailable = build_cases(args.cases, device, args.chunk_mib)
    first, losses = warm_up(cases, inputs, device, args.warmup)
    cases = [case for case in cases if case.name in losses]
    times = timed_rounds(cases, inputs, device, args.repeats)
    common = {"schema": SCHEMA, "device": device_name(device), "torch": torch.__version__, "dtype": args.dtype,
              "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "timed_calls": args.repeats,
              "torch_threads": torch.get_num_threads()}
    rows = []
    for case in cases:
        wall, cpu = zip(*times[case.name])
        rows.append({**common, "case": case.name, "label": case.label, "ms_median": statistics.median(wall),
                     "ms_min": min(wall), "ms_max": max(wall), "cpu_ms_median": statistics.median(cpu),
                     "first_call_s": first[case.name], "peak_bytes": peak_bytes(case, inputs, device),
                     "saved_bytes": saved_bytes(case, inputs), "loss": losses[case.name]})
    failed = {name: error for name, error in first.items() if isinstance(error, str)}
    rows += [{**common, "case": name, "unavailable": why} for name, why in {**unavailable, **failed}.items()]
    return rows


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()


def markdown(rows: list[dict]) -> str:
    timed = [r for r in rows if "ms_median" in r]
    head = rows[0]
    reference = next((r["ms_median"] for r in timed if r["case"] == RATIO_TO), None)
    lines = [f"Loss forward + backward, {head['tokens']} tokens, h {head['hidden']}, V {head['vocab']}, "
             f"{head['dtype']}, {head['device']}, torch {head['torch']}, {head['timed_calls']} timed calls per case",
             "",
             f"| case | median ms | min | max | × {RATIO_TO} | process CPU ms | first call s | peak MiB "
             "| saved for backward MiB | loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in timed:
        ratio = f"{r['ms_median'] / reference:.2f}" if reference else "–"
        peak = "–" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        lines.append(f"| {r['label']} | {r['ms_median']:.2f} | {r['ms_min']:.2f} | {r['ms_max']:.2f} | {ratio} | "
                     f"{r['cpu_ms_median']:.2f} | {r['first_call_s']:.1f} | {peak} | {r['saved_bytes'] / 2**20:.1f} | "
                     f"{r['loss']:.5f} |")
    lines += [f"| {r['case']}: not run ({r['unavailable']}) |" + " |" * 9 for r in rows if "unavailable" in r]
    return "\n".join(lines)


def parse_args(argv: list[str] | None, device: torch.device) -> argparse.Namespace:
    on_gpu = device.type == "cuda"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64 * 512 if on_gpu else 2 * 512, help="micro-batch × sequence")
    parser.add_argument("--hidden", type=int, default=768 if on_gpu else 64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if on_gpu else "fp32")
    parser.add_argument("--chunk-mib", default=str(cross_entropy.LOGITS_CHUNK_BYTES // 2**20),
                        help="comma-separated chunk budgets of the compiled-chunks case, MiB")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per case first (at least 1)")
    default_cases = CASES if on_gpu else tuple(c for c in CASES if c != "torch_chunked")
    parser.add_argument("--cases", default=",".join(default_cases), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own)")
    parser.add_argument("--jsonl", type=Path, help="write one JSON line per case here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    args.chunk_mib = [int(m) for m in args.chunk_mib.split(",") if m]
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown or args.repeats < 1 or args.warmup < 1 or not args.chunk_mib:
        parser.error(f"unknown cases {unknown}" if unknown else "--repeats, --warmup and --chunk-mib must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = parse_args(argv, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args, device)
    command = rerun_command(__spec__.name, argv)
    lines = "".join(json.dumps({**row, "command": command}) + "\n" for row in rows)
    publish(markdown(rows), lines, args.jsonl, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
