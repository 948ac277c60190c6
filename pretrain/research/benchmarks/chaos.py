"""Chaos benchmark: does a run with faults finish with no one watching, and what do the faults cost?

    python -m pretrain.research.benchmarks.chaos --out runs/chaos --steps 1000 [--seed 0] [--json chaos.json]
    nohup python -m pretrain.research.benchmarks.chaos --out runs/chaos --steps 1000 > runs/chaos.log 2>&1 &

Trains the `tiny` preset (its mock-data form: no shards needed; 2 CPU processes, gloo, ZeRO-1) twice
through the training entry (`python -m pretrain.pretrain_ora ... --nproc-per-node 2`): once without
process faults (the reference), once with faults at seeded steps: SIGKILL of a worker (a crash, the
OOM killer), SIGSTOP of a worker (a hang: a rank's watchdog reports it), a SIGTERM to the job (a
preemption: the job saves and ends; this script then runs the same command again, as a requeuing
scheduler would). Loss faults are data, in both runs alike: a loss spike at a seeded batch (skipped,
stability.spike_skip) and non-finite losses at stability.max_consecutive_skips batches in a row (a divergence:
rewound past them, stability.rewind). Both runs use the same unattended settings (restarts, watchdog,
skip-step, rewind, a checkpoint every --save-interval steps).

It reports whether the chaos run finished, the human actions it needed (a job that ended for good
before the run did: someone would have to look; must be 0), restarts, hangs, requeues, steps redone,
the wall time of both (from the first command to the last one's exit, start-ups included), goodput
(the reference's wall time ÷ the chaos run's) and whether the chaos run's losses equal the reference's,
bitwise (every logged step, and the final train and test loss). It also measures what the model below
takes: the save time of a checkpoint (its files' first write to its integrity record) and the restart
time (a failed job's record to its relaunched workers training again).

Beside it, on paper (`paper_table`): the goodput of Base (12 layers, d 768) on 16 nodes of 8 GPUs
against the checkpoint interval and the job's mean time between failures, from first-order
Young/Daly: a failure loses on average half an interval plus the restart, and every interval pays
one save:

    goodput(τ) = τ / (τ + C) · (1 − (R + (τ + C) / 2) / M),     τ_opt = √(2 C M) − C   (Daly 2006)

with C the save time, R the restart time and M the job's MTBF: C is Base's save as measured on this
machine (--base-save-s), R the restart measured here plus loading Base's checkpoint (--base-load-s);
a hang adds the presets' hang timeout. Results go to --out/chaos.json (or
--json) and a markdown table to stdout; the runs stay in --out, so the same command continues an
interrupted benchmark (a finished run is not trained again).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pretrain.paths import REPO, preset_path
from pretrain.run_files.run_dir import RunDir

SCHEMA = "ora-chaos/1"
PROCESS_KINDS = ("kill", "stop", "preempt")
EXIT_WALL_TIME = 75  # pretrain/pretrain_ora.py
MAX_JOBS = 20  # a chaos run that needs more jobs than this is not going to finish
# Llama 3 (16,384 H100, 54 days): 419 unexpected interruptions (DESIGN.md §4).
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)


@dataclass
class Fault:
    kind: str  # kill | stop | preempt | spike | nan (the first batch of a non-finite streak)
    step: int  # process faults: after this step; loss faults: at this batch
    rank: int = 0
    job: int = 0  # which job of the run it happens in (a preemption ends one)
    attempt: int = 0  # which attempt of that job (a kill or a hang restarts it)

    def overrides(self, streak: int) -> list[dict]:
        """Its entries of faults."""
        if self.kind == "spike":
            return [{"kind": "spike", "batch": self.step, "factor": 100.0}]
        if self.kind == "nan":
            return [{"kind": "nan", "batch": self.step + i} for i in range(streak)]
        return [{"kind": self.kind, "step": self.step, "rank": self.rank, "attempt": self.attempt}]


def plan_faults(seed: int, steps: int, kinds: list[str], nproc: int) -> list[Fault]:
    """Faults of `kinds` at seeded steps in the middle 80% of the run, at least steps/20 apart, in a
    seeded order; each process fault knows the job and attempt it happens in."""
    rng = random.Random(seed)
    low, high, gap = steps // 10, steps - steps // 10, max(steps // 20, 1)
    chosen: list[int] = []
    while len(chosen) < len(kinds):
        step = rng.randint(low, high)
        if all(abs(step - other) >= gap for other in chosen):
            chosen.append(step)
    order = list(kinds)
    rng.shuffle(order)
    faults = [Fault(kind, step, rank=rng.randrange(nproc)) for kind, step in zip(order, sorted(chosen))]
    job = attempt = 0
    for fault in faults:
        if fault.kind in PROCESS_KINDS:
            fault.job, fault.attempt = job, attempt
            if fault.kind == "preempt":
                job, attempt = job + 1, 0
            else:
                attempt += 1
    return faults


def run_overrides(steps: int, save_interval: int, wandb_mode: str = "disabled") -> list[str]:
    """The `tiny` preset on mock data, writing metrics.jsonl, checkpoints and wandb in `wandb_mode`, no more."""
    return [f"train.steps={steps}", "data.mock=true", "data.manifest=null", f"logging.wandb_mode={wandb_mode}",
            "logging.tensorboard=false", "logging.progress=false", f"checkpoint.save_interval={save_interval}"]


def entry_command(run_dir: Path, nproc: int, overrides: list[str]) -> list[str]:
    """The training entry on the `tiny` preset, as a user runs it."""
    command = [sys.executable, "-m", "pretrain.pretrain_ora", "--config", str(preset_path("tiny")), "--run-dir",
               str(run_dir), "--nproc-per-node", str(nproc)]
    for item in overrides:
        command += ["--set", item]
    return command


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [*run_overrides(args.steps, args.save_interval), "checkpoint.keep_last=3",
            f"supervision.max_restarts={args.max_restarts}",
            "supervision.restart_backoff_s=1", f"supervision.hang_timeout_s={args.hang_timeout}",
            f"supervision.collective_timeout_s={int(max(4 * args.hang_timeout, 120))}",
            "stability.spike_skip={enabled: true, window: 128, sigma: 6.0}",
            f"stability.max_consecutive_skips={args.streak}",
            f"stability.rewind={{enabled: true, skip_batches: {args.rewind_skip}, max_rewinds: 3}}"]


def fault_override(faults: list[Fault], streak: int) -> str:
    entries = [entry for fault in faults for entry in fault.overrides(streak)]
    return "faults=" + json.dumps(entries)


@dataclass
class Jobs:
    """The jobs a run took: each command's status and wall time."""

    statuses: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    human_actions: int = 0
    requeues: int = 0


def run_jobs(name: str, out: Path, overrides: list[str], nproc: int, steps: int, log) -> Jobs:
    """The same command until the run has finished, as a requeuing scheduler would: again after a stop
    on request or at max_wall_time (a requeue), again after any other end before the last step (a human
    action). A finished run's timing is read back from its file."""
    run_dir, timing = out / name, out / f"{name}.jobs.json"
    if timing.exists() and finished(RunDir(run_dir), steps):
        return Jobs(**json.loads(timing.read_text()))
    command = entry_command(run_dir, nproc, overrides)
    jobs = Jobs()
    while len(jobs.statuses) < MAX_JOBS:
        started = time.time()
        with open(out / f"{name}.log", "a") as output:
            output.write(f"\n=== job {len(jobs.statuses) + 1}: {' '.join(command)}\n")
            output.flush()
            status = subprocess.run(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT).returncode
        jobs.statuses.append(status)
        jobs.seconds.append(time.time() - started)
        log(f"{name}: job {len(jobs.statuses)} exited {status} after {jobs.seconds[-1]:.0f} s")
        if finished(RunDir(run_dir), steps):
            break
        summary = RunDir(run_dir).read_summary() if RunDir(run_dir).summary.exists() else None
        if status == EXIT_WALL_TIME or (status == 0 and summary is not None and summary.preempted):
            jobs.requeues += 1
        else:
            jobs.human_actions += 1
    timing.write_text(json.dumps(asdict(jobs)))
    return jobs


def finished(run_dir: RunDir, steps: int) -> bool:
    if not run_dir.summary.exists():
        return False
    summary = run_dir.read_summary()
    return summary.steps == steps and not summary.preempted and summary.stop_reason is None


def save_seconds(run_dir: RunDir) -> list[float]:
    """Per kept checkpoint: its integrity record's time less its oldest file's (the save's span)."""
    spans = []
    for tag in run_dir.checkpoint_tags():
        files = [p.stat().st_mtime for p in run_dir.checkpoint(tag).rglob("*") if p.is_file()
                 and p.name != "integrity.json" and p.parent.name != "topology_free"]
        record = run_dir.integrity_record_file(tag)
        if files and record.exists():
            spans.append(record.stat().st_mtime - min(files))
    return spans


def checkpoint_bytes(run_dir: RunDir) -> int:
    tags = run_dir.checkpoint_tags()
    return sum(p.stat().st_size for p in run_dir.checkpoint(tags[-1]).rglob("*") if p.is_file()) if tags else 0


def restart_seconds(run_dir: RunDir) -> list[float]:
    """Per restart: from the failed job's record to its relaunched workers training again (the
    restart event they log), less the backoff: detection, kill, start-up, checkpoint load."""
    records = run_dir.read_restarts()
    events = [r for r in run_dir.read_records("event") if r.kind == "restart"]
    spans = []
    for event in events:
        back = event.detail.get("training_again_at")
        record = next((r for r in records if r.time == event.detail.get("time")), None)
        if back is not None and record is not None:
            failed = datetime.datetime.fromisoformat(record.time).timestamp()
            spans.append(back - failed - record.backoff_s)
    return spans


def losses(run_dir: RunDir) -> dict[int, float]:
    return {r.step: r.loss for r in run_dir.read_records("train")}


# ---------------------------------------------------------------------- on paper
def goodput(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """First-order Young/Daly: the share of wall time that trains, with a save every `interval_s` of
    training, failures at rate 1/mtbf_s, each losing half an interval and save plus a restart."""
    lost = (restart_s + (interval_s + save_s) / 2) / mtbf_s
    return max(interval_s / (interval_s + save_s) * (1 - lost), 0.0)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_s * mtbf_s) - save_s if save_s < mtbf_s / 2 else mtbf_s


BASE = {"layers": 12, "d": 768, "ffn": 3072, "vocab": 32000, "seq": 512, "frozen_qk": 2 * 12 * 768 * 768}


def base_checkpoint_bytes() -> int:
    """Base's checkpoint under the presets' bf16 ZeRO-1: bf16 weights (frozen Q/K included) plus the
    fp32 master weights and two Adam moments of the trainable ones (biases and norms included)."""
    d, ffn, layers = BASE["d"], BASE["ffn"], BASE["layers"]
    per_layer = 4 * d * d + 4 * d + 2 * d * ffn + ffn + d + 4 * d  # attention, MLP, two norms
    params = layers * per_layer + BASE["vocab"] * d + BASE["seq"] * d + 2 * d
    return 2 * params + 12 * (params - BASE["frozen_qk"])


SLOW_RESTART_S = 300.0  # a restart of 5 minutes: start-up on many nodes (imports from a shared file system, NCCL)


def paper_table(save_s: float, restart_s: float, hang_timeout_s: float) -> dict:
    """Goodput of Base on 16 nodes × 8 GPUs against the checkpoint interval and the job's MTBF, and at
    the Daly interval: with the restart measured, with every failure a hang (its timeout on top), and
    with a 5-minute restart."""
    gpus = 16 * 8
    llama3_mtbf_h = 1 / (LLAMA3_FAILURES_PER_GPU_HOUR * gpus)
    mtbfs_h = [4, 12, 24, 96, round(llama3_mtbf_h)]
    intervals_min = [5, 10, 20, 40, 80]
    rows = []
    for mtbf_h in mtbfs_h:
        mtbf = mtbf_h * 3600
        best = daly_interval(save_s, mtbf)
        rows.append({"mtbf_h": mtbf_h, "goodput": [goodput(m * 60, save_s, restart_s, mtbf) for m in intervals_min],
                     "daly_interval_min": best / 60, "goodput_at_daly": goodput(best, save_s, restart_s, mtbf),
                     "goodput_hangs_only": goodput(best, save_s, restart_s + hang_timeout_s, mtbf),
                     "goodput_slow_restart": goodput(best, save_s, SLOW_RESTART_S, mtbf)})
    return {"gpus": gpus, "save_s": save_s, "restart_s": restart_s, "hang_timeout_s": hang_timeout_s,
            "intervals_min": intervals_min, "llama3_mtbf_h": llama3_mtbf_h, "rows": rows}


# ---------------------------------------------------------------------- the report
def table(result: dict) -> str:
    chaos, ref = result["chaos"], result["reference"]
    faults = ", ".join(f"{f['kind']}@{f['step']}" + (f"/rank{f['rank']}" if f["kind"] in ("kill", "stop") else "")
                       for f in result["faults"])
    lines = [
        f"| chaos run ({result['steps']} steps, {result['nproc']} processes, seed {result['seed']}) | |",
        "|---|---|",
        f"| faults ({len(result['faults'])}, {len({f['kind'] for f in result['faults']})} kinds) | {faults} |",
        f"| finished | {chaos['finished']} |",
        f"| human actions | {chaos['human_actions']} |",
        f"| jobs (requeues after a preemption) | {len(chaos['statuses'])} ({chaos['requeues']}) |",
        f"| restarts (of them hangs) | {chaos['restarts']} ({chaos['hangs']}) |",
        f"| steps redone after restarts | {chaos['steps_redone']} |",
        f"| spike skips, rewinds (both runs) | {chaos['spike_skips']}, {chaos['rewinds']} |",
        f"| wall time: reference, chaos | {ref['wall_s']:.0f} s, {chaos['wall_s']:.0f} s |",
        f"| goodput (reference ÷ chaos wall time) | {result['goodput']:.3f} |",
        f"| losses equal to the reference, bitwise (every step; final train, test) | "
        f"{result['losses_equal']} ({result['final_train_equal']}, {result['final_test_equal']}) |",
        f"| measured: save (median), restart (median, detection to training again) | "
        f"{result['save_s']:.2f} s, {result['restart_s']:.1f} s |",
    ]
    paper = result["paper"]
    head = " | ".join(f"{m} min" for m in paper["intervals_min"])
    lines += ["", f"Base on 16 nodes × 8 GPUs (C = {paper['save_s']:.1f} s a save, R = {paper['restart_s']:.0f} s "
              f"a restart): goodput by checkpoint interval and the job's MTBF", "",
              f"| job MTBF | {head} | Daly interval | goodput there | every failure a hang "
              f"(+{paper['hang_timeout_s']:.0f} s) | R = {SLOW_RESTART_S / 60:.0f} min |",
              "|---|" + "---|" * (len(paper["intervals_min"]) + 4)]
    for row in paper["rows"]:
        cells = " | ".join(f"{g:.3f}" for g in row["goodput"])
        lines.append(f"| {row['mtbf_h']} h | {cells} | {row['daly_interval_min']:.1f} min | "
                     f"{row['goodput_at_daly']:.3f} | {row['goodput_hangs_only']:.3f} | "
                     f"{row['goodput_slow_restart']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of the two runs, their logs and the results")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="seeds the faults' steps, ranks and order")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--kinds", default="kill,stop,preempt,spike,nan,kill,stop",
                        help="the faults, by kind (kill, stop, preempt, spike, nan)")
    parser.add_argument("--save-interval", type=int, default=50)
    parser.add_argument("--hang-timeout", type=float, default=20.0, help="supervision.hang_timeout_s")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--streak", type=int, default=3, help="stability.max_consecutive_skips: the nan fault's length")
    parser.add_argument("--rewind-skip", type=int, default=10, help="stability.rewind.skip_batches")
    parser.add_argument("--base-save-s", type=float, default=8.6,
                        help="Base's save: torch.save (7 s) and hashing (1.6 s) of its 1.37 GB checkpoint, "
                             "measured on this machine (RESULTS.md, Where the time goes)")
    parser.add_argument("--base-load-s", type=float, default=3.5,
                        help="Base's load and check on resume (torch.load 1.3-2 s, hashing 1.6 s, measured), "
                             "added to the measured restart")
    parser.add_argument("--json", help="default: OUT/chaos.json")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    def log(text: str) -> None:
        print(f"[{datetime.datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)

    faults = plan_faults(args.seed, args.steps, [k for k in args.kinds.split(",") if k], args.nproc)
    loss_faults = [f for f in faults if f.kind not in PROCESS_KINDS]
    common = common_overrides(args)
    log(f"faults: {[asdict(f) for f in faults]}")
    reference = run_jobs("reference", out, [*common, fault_override(loss_faults, args.streak)], args.nproc,
                         args.steps, log)
    chaos = run_jobs("chaos", out, [*common, fault_override(faults, args.streak)], args.nproc, args.steps, log)

    ref_dir, chaos_dir = RunDir(out / "reference"), RunDir(out / "chaos")
    ref_summary, chaos_summary = ref_dir.read_summary(), chaos_dir.read_summary()
    restarts = [r for r in chaos_dir.read_restarts() if r.action == "restart"]
    saves, back = save_seconds(chaos_dir) + save_seconds(ref_dir), restart_seconds(chaos_dir)
    measured_save = statistics.median(saves) if saves else 0.0
    measured_restart = statistics.median(back) if back else 0.0
    result = {
        "schema": SCHEMA, "date": datetime.date.today().isoformat(), "steps": args.steps, "seed": args.seed,
        "nproc": args.nproc, "save_interval": args.save_interval, "hang_timeout_s": args.hang_timeout,
        "faults": [asdict(f) for f in faults],
        "reference": {"wall_s": sum(reference.seconds), "statuses": reference.statuses,
                      "train_loop_s": ref_summary.wall_time_s},
        "chaos": {"finished": finished(chaos_dir, args.steps), "human_actions": chaos.human_actions,
                  "statuses": chaos.statuses, "requeues": chaos.requeues, "wall_s": sum(chaos.seconds),
                  "restarts": len(restarts), "hangs": sum(bool(r.hang_dumps) for r in restarts),
                  "steps_redone": sum(r.steps_redone or 0 for r in restarts),
                  "spike_skips": chaos_summary.spike_skips, "rewinds": len(chaos_summary.rewinds),
                  "restart_records": [{k: v for k, v in asdict(r).items() if k != "log_tail"} for r in restarts]},
        "goodput": sum(reference.seconds) / sum(chaos.seconds),
        "losses_equal": losses(chaos_dir) == losses(ref_dir),
        "final_train_equal": chaos_summary.final_train_loss == ref_summary.final_train_loss,
        "final_test_equal": chaos_summary.final_test_loss == ref_summary.final_test_loss,
        "save_s": measured_save, "restart_s": measured_restart, "checkpoint_bytes": checkpoint_bytes(chaos_dir),
        "base_checkpoint_bytes": base_checkpoint_bytes(),
    }
    # The presets' hang timeout (300 s) comes on top of a hang's restart.
    result["paper"] = paper_table(args.base_save_s, measured_restart + args.base_load_s, 300.0)
    path = Path(args.json) if args.json else out / "chaos.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    log(f"results: {path}")
    return 0 if result["chaos"]["finished"] and result["chaos"]["human_actions"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
