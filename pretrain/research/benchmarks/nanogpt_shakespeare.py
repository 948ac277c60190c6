"""The nanoGPT `shakespeare_char` CPU yardstick: our whole stack beside nanoGPT itself, in one invocation.

    python -m pretrain.research.benchmarks.nanogpt_shakespeare --input runs/data/tinyshakespeare.txt \
        [--nanogpt PATH_TO_NANOGPT_CHECKOUT] [--out-dir runs/bench/shakespeare] [--steps 2000] \
        [--attention vanilla ora] [--slice 3]

Recipe (nanoGPT README, CPU: `config/train_shakespeare_char.py` with device=cpu compile=False
eval_iters=20 log_interval=1 block_size=64 batch_size=12 n_layer=4 n_head=4 n_embd=128
max_iters=2000 lr_decay_iters=2000 dropout=0.0): char-level, first 90% of the characters for
training and the last 10% for validation; lr 1e-3 with 100 warmup steps and cosine decay to 1e-4,
beta2 0.99, weight decay 0.1, clip 1.0, validation every 250 steps. Ours runs the same recipe through
the real entry points: data_tools.train_tokenizer (sentencepiece char model), data_tools.build_shards,
pretrain.pretrain_ora (one process, ZeRO-0, fp32, metrics every step). nanoGPT runs from a
checkout (its train.py, unchanged) on the same text and split, written here in its data format
(train.bin / val.bin of uint16 character ids, meta.pkl), twice: as the recipe has it (bias=False)
and with bias=True, which adds the biases of every linear and LayerNorm that our gpt2 family has:
that second run computes what ours computes, the first is the recipe's yardstick.

Side by side: all runs start together and take turns on the machine, `--slice` seconds each (every
other run stopped with SIGSTOP meanwhile), so each sees the same background load; `--slice 0` runs
them one after the other. Throughput, the same definition for both: tokens per iteration
(12 × 64) / the median iteration time over steady-state iterations — the first 10 left out, and
nanoGPT's evaluation iterations (its printed time includes the evaluation and checkpoint; ours
excludes both by construction). The few iterations cut by a turn change are outliers the median
ignores. Writes results.json and prints a table: median ms/iteration, tokens/s, the ratios to both nanoGPT runs,
final validation loss, process wall time (its own turns only).

--steps shortens every run (max_iters = lr_decay_iters = steps; validation every 250 steps, or only
at the end when steps is not a multiple of 250); medians after warm-up favour neither side.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from pretrain.paths import ENTRY_MODULE, PRESETS, REPO
from pretrain.run_files.run_dir import RunDir

BLOCK, BATCH = 64, 12
TOKENS_PER_ITER = BLOCK * BATCH
EVAL_INTERVAL = 250  # config/train_shakespeare_char.py
WARMUP_ITERS = 10
NANOGPT_OVERRIDES = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
                     f"--block_size={BLOCK}", f"--batch_size={BATCH}", "--n_layer=4", "--n_head=4",
                     "--n_embd=128", "--dropout=0.0"]
NANOGPT_ITER = re.compile(r"^iter (\d+): loss [-\d.naninf]+, time ([\d.]+)ms", re.MULTILINE)
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)", re.MULTILINE)


def run(args: list[str]) -> None:
    subprocess.run([sys.executable, *args], cwd=REPO, check=True)


def split_text(text_path: Path) -> dict[str, str]:
    text = text_path.read_text()
    cut = int(0.9 * len(text))
    return {"train": text[:cut], "valid": text[cut:]}


def prepare_data(parts: dict[str, str], data_dir: Path) -> tuple[Path, Path, Path, int]:
    """Train a char tokenizer on the train part, shard both parts."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, part in parts.items():
        (data_dir / f"{name}.txt").write_text(part)
    # sentencepiece reads text line by line: newlines are unseen and map to <unk>, one token per
    # newline, so a token is still a character. 4 = unk, bos, eos, pad.
    vocab = len(set(parts["train"]) - {"\n"}) + 4
    tokenizer = data_dir / "tokenizer" / "sp"
    run(["-m", "data_tools.train_tokenizer", "--input", str(data_dir / "train.txt"), "--txt-mode", "file",
         "--model-prefix", str(tokenizer), "--vocab-size", str(vocab), "--model-type", "char"])
    for name in parts:
        run(["-m", "data_tools.build_shards", "--input", str(data_dir / f"{name}.txt"), "--txt-mode", "file",
             "--tokenizer", f"{tokenizer}.model", "--output-dir", str(data_dir / f"shards_{name}"), "--quiet"])
    return data_dir / "shards_train", data_dir / "shards_valid", Path(f"{tokenizer}.model"), vocab


def prepare_nanogpt_data(parts: dict[str, str], work_dir: Path, checkout: Path) -> None:
    """nanoGPT's working directory: data/shakespeare_char/{train,val}.bin (uint16 ids of the characters,
    the vocabulary being every character of the whole text, sorted) and meta.pkl (vocab_size, itos,
    stoi), which its train.py reads; and its configurator.py, which train.py opens from the working
    directory (linked, not copied)."""
    data_dir = work_dir / "data" / "shakespeare_char"
    data_dir.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(parts["train"]) | set(parts["valid"]))
    stoi = {c: i for i, c in enumerate(chars)}
    for name, file in (("train", "train.bin"), ("valid", "val.bin")):
        np.array([stoi[c] for c in parts[name]], dtype=np.uint16).tofile(data_dir / file)
    with open(data_dir / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    link = work_dir / "configurator.py"
    if not link.exists():
        link.symlink_to(checkout / "configurator.py")


def eval_interval(steps: int) -> int:
    return EVAL_INTERVAL if steps % EVAL_INTERVAL == 0 else steps


# Ours as the recipe's comparison runs it ("lean": ZeRO-0, no TensorBoard, wandb or progress bar) or
# with what pretrain/configs/tiny.yaml and the config's defaults give a user who sets nothing ("defaults").
LEAN = {"deepspeed": {"zero_stage": 0, "precision": "fp32"},
        "logging": {"wandb_mode": "disabled", "tensorboard": False, "progress": False}}
SETTINGS = ("lean", "defaults")


def settings_sections(settings: str) -> dict:
    if settings == "lean":
        return LEAN
    tiny = yaml.safe_load((PRESETS / "tiny.yaml").read_text())
    return {"deepspeed": tiny["deepspeed"], "logging": tiny["logging"]}


def run_config(attention: str, steps: int, vocab: int, train_shards: Path, valid_shards: Path, tokenizer: Path,
               settings: str = "lean") -> dict:
    from data_tools.manifest import blend_from_manifest

    def blend(shards: Path) -> list[dict]:
        prefixes, weights = blend_from_manifest(str(shards))["train"]
        return [{"path": p, "weight": w} for p, w in zip(prefixes, weights)]

    return {
        "model": {"family": "gpt2", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                  "ffn_hidden_size": 512, "seq_length": BLOCK, "vocab_size": vocab,
                  "make_vocab_size_divisible_by": 1, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                  "seed": 1337, "attention": {"type": attention}},
        "train": {"micro_batch_size": BATCH, "global_batch_size": BATCH, "steps": steps, "log_interval": 1,
                  "eval_interval": eval_interval(steps), "eval_iters": 20},
        "optimizer": {"lr": 1e-3, "min_lr_ratio": 0.1, "warmup_steps": 100, "decay_style": "cosine",
                      "decay_steps": steps, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "clip_grad": 1.0},
        "data": {"train_blend": blend(train_shards), "valid_blend": blend(valid_shards),
                 "test_blend": blend(valid_shards), "tokenizer": str(tokenizer)},
        **settings_sections(settings),
        "checkpoint": {"save_interval": steps, "keep_last": 1},
    }


@dataclass
class Job:
    """One training process; `active_s` counts only the time it was allowed to run."""

    name: str
    argv: list[str]
    cwd: Path
    log: Path
    proc: Optional[subprocess.Popen] = None
    active_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def resume(self) -> None:
        if self.proc is None:
            with open(self.log, "w") as log:  # its own process group: stopping it stops its children too
                self.proc = subprocess.Popen(self.argv, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        else:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run_in_turns(jobs: list[Job], slice_s: float) -> None:
    """Run the jobs in turns of `slice_s` seconds (0: each to its end) until every one has exited."""
    queue = list(jobs)
    try:
        while queue:
            job = queue.pop(0)
            started = time.monotonic()
            job.resume()
            try:
                job.proc.wait(timeout=slice_s if slice_s > 0 else None)
            except subprocess.TimeoutExpired:
                job.pause()
                queue.append(job)
            job.active_s += time.monotonic() - started
            if job.proc.returncode not in (None, 0):
                raise RuntimeError(f"{job.name} failed with exit code {job.proc.returncode}; see {job.log}")
    finally:
        for job in jobs:
            job.kill()


def steady_median_ms(times_by_iter: dict[int, float], skip) -> float:
    kept = [t for i, t in sorted(times_by_iter.items()) if i >= WARMUP_ITERS and not skip(i)]
    return statistics.median(kept) * 1e3


def nanogpt_job(checkout: Path, work_dir: Path, steps: int, bias: bool) -> Job:
    """The recipe (bias=False, nanoGPT's default), or with bias=True: biases in every linear and
    LayerNorm, as our gpt2 family has them, so the same computation as ours."""
    name = "nanoGPT+bias" if bias else "nanoGPT"
    argv = [sys.executable, str(checkout / "train.py"), str(checkout / "config" / "train_shakespeare_char.py"),
            *NANOGPT_OVERRIDES, f"--bias={bias}", f"--max_iters={steps}", f"--lr_decay_iters={steps}",
            f"--eval_interval={eval_interval(steps)}", f"--out_dir={work_dir / ('out_bias' if bias else 'out')}"]
    return Job(name, argv, work_dir, work_dir / ("train_bias.log" if bias else "train.log"))


def nanogpt_result(job: Job, steps: int) -> dict:
    log = job.log.read_text()
    times = {int(i): float(ms) / 1e3 for i, ms in NANOGPT_ITER.findall(log)}
    evals = NANOGPT_EVAL.findall(log)
    every = eval_interval(steps)
    # iter i's printed time includes the evaluation (and checkpoint) run before it when i % every == 0
    median_ms = steady_median_ms(times, skip=lambda i: i % every == 0)
    return {"name": job.name, "median_iter_ms": median_ms, "tokens_per_s": TOKENS_PER_ITER / median_ms * 1e3,
            "final_valid_loss": float(evals[-1][2]), "iterations": len(times), "process_wall_s": job.active_s,
            "log": str(job.log)}


def our_name(attention: str, settings: str) -> str:
    return f"ours ({attention})" if settings == "lean" else f"ours ({attention}, {settings})"


def our_job(out_dir: Path, attention: str, settings: str, config: dict) -> Job:
    stem = attention if settings == "lean" else f"{attention}_{settings}"
    config_path = out_dir / f"{stem}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    run_dir = out_dir / f"run_{stem}"
    argv = [sys.executable, "-m", ENTRY_MODULE, "--config", str(config_path),
            "--run-dir", str(run_dir)]
    return Job(our_name(attention, settings), argv, REPO, out_dir / f"{stem}.log",
               extra={"run_dir": run_dir, "attention": attention, "settings": settings})


def our_result(job: Job) -> dict:
    run_dir = RunDir(job.extra["run_dir"])
    summary = run_dir.read_summary()
    # step s is the s-th iteration (nanoGPT's iter s-1); its time excludes evaluation and checkpoints
    times = {r.step - 1: r.step_time_s for r in run_dir.read_records("train")}
    median_ms = steady_median_ms(times, skip=lambda i: False)
    return {"name": job.name, "attention": job.extra["attention"], "settings": job.extra["settings"],
            "median_iter_ms": median_ms,
            "tokens_per_s": TOKENS_PER_ITER / median_ms * 1e3, "final_valid_loss": summary.final_valid_loss,
            "iterations": len(times), "process_wall_s": job.active_s, "trainable_params": summary.trainable_params,
            "frozen_params": summary.frozen_params, "run_dir": str(run_dir.path)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout, run beside ours (its train.py)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "runs" / "bench" / "shakespeare")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--attention", nargs="+", default=["vanilla", "ora"])
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=["lean"],
                        help="ours with ZeRO-0 and logging off (lean), and/or as tiny.yaml configures it (defaults)")
    parser.add_argument("--slice", type=float, default=3.0,
                        help="seconds per turn when the runs alternate (0: one after the other)")
    args = parser.parse_args(argv)
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = split_text(args.input.resolve())
    train_shards, valid_shards, tokenizer, vocab = prepare_data(parts, out_dir / "data")
    jobs = [our_job(out_dir, attention, settings,
                    run_config(attention, args.steps, vocab, train_shards, valid_shards, tokenizer, settings))
            for attention in args.attention for settings in args.settings]
    for job in jobs:  # a rerun starts afresh rather than resuming a finished run
        shutil.rmtree(job.extra["run_dir"], ignore_errors=True)
    ours = list(jobs)
    nanogpt = []
    if args.nanogpt:
        checkout = args.nanogpt.resolve()
        work_dir = out_dir / "nanogpt"
        prepare_nanogpt_data(parts, work_dir, checkout)
        nanogpt = [nanogpt_job(checkout, work_dir, args.steps, bias) for bias in (False, True)]
        jobs = nanogpt + jobs
    run_in_turns(jobs, args.slice)

    import torch

    results = [our_result(job) for job in ours]
    references = [nanogpt_result(job, args.steps) for job in nanogpt]
    reference, with_bias = references if references else (None, None)
    for r in results:
        r["ratio_to_nanogpt"] = r["tokens_per_s"] / reference["tokens_per_s"] if reference else None
        r["ratio_to_nanogpt_bias"] = r["tokens_per_s"] / with_bias["tokens_per_s"] if with_bias else None
    report = {"recipe": "nanoGPT shakespeare_char CPU", "steps": args.steps, "eval_interval": eval_interval(args.steps),
              "tokens_per_iteration": TOKENS_PER_ITER, "warmup_iterations_left_out": WARMUP_ITERS,
              "slice_s": args.slice, "vocab": vocab, "torch_threads": torch.get_num_threads(),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "nanogpt": reference,
              "nanogpt_bias": with_bias, "results": results,
              "command": " ".join([Path(sys.executable).name, *sys.argv])}
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'run':<28}{'ms/iter':>9}{'tokens/s':>10}{'× nanoGPT':>11}{'× +bias':>9}{'val loss':>10}{'wall s':>8}")
    for r in references + results:
        ratios = [f"{r[k]:.3f}" if r.get(k) else "-" for k in ("ratio_to_nanogpt", "ratio_to_nanogpt_bias")]
        print(f"{r['name']:<28}{r['median_iter_ms']:>9.2f}{r['tokens_per_s']:>10,.0f}{ratios[0]:>11}{ratios[1]:>9}"
              f"{r['final_valid_loss']:>10.4f}{r['process_wall_s']:>8.1f}")
    print(f"median over iterations {WARMUP_ITERS}.. (nanoGPT's evaluation iterations left out), "
          f"turns of {args.slice} s, torch threads {torch.get_num_threads()}; results: {out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
