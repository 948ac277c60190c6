"""What a run reports as it goes: typed records in metrics.jsonl, TensorBoard, wandb, a progress bar.

The logger decides when a training step is logged and builds each record itself (throughput,
peak memory, MFU). Every rank holds one; only rank 0 writes anything. The progress bar moves at
every step and shows the loss of the last logged one (the loss leaves the device only when logged).
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Iterator, Optional

import torch.distributed as dist

from pretrain.config import RunConfig, config_hash
from pretrain.run_dir import EvalRecord, Record, RunDir, TrainRecord, write_text_atomic
from pretrain.runtime.accounting import device_peak_tflops, flops_per_token, peak_memory_bytes


class IterationTimer:
    """Wall time of each training iteration: from the end of one train step to the end of the next,
    so it holds the loop's own work too (LR schedule, logging, the preemption check), like nanoGPT's
    per-iteration time; evaluation and checkpoint saves are left out (`paused`), like Megatron-LM's
    interval timer, so a step's throughput does not depend on the cadence of either."""

    def __init__(self):
        self._mark = time.perf_counter()
        self._paused = 0.0

    def lap(self) -> float:
        """Seconds since the previous lap (or the timer's start), pauses excluded."""
        now = time.perf_counter()
        elapsed = now - self._mark - self._paused
        self._mark, self._paused = now, 0.0
        return elapsed

    @contextmanager
    def paused(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start


def wandb_run_id(run_dir: RunDir, cfg: RunConfig) -> str:
    """The run's wandb id: made at its first start and kept in the run dir (wandb/run_id), so every
    resume continues the same W&B run, with changed settings or from a moved run dir too.

    It is a hash of what makes the run this run: the run dir's absolute path, the config and the
    time of the first start; not the folder's name, which a sweep repeats (`<arm>/seed<N>`) and which
    may hold characters wandb refuses in ids (`:;,#?/'`). A sweep's arms and seeds differ in path and
    config; a run started afresh where another was deleted is a new W&B run, whose steps wandb would
    otherwise drop as going back in time.
    """
    stored = run_dir.path / "wandb" / "run_id"
    if stored.is_file() and stored.read_text().strip():
        return stored.read_text().strip()
    identity = f"{run_dir.path.resolve()}\n{config_hash(cfg)}\n{time.time_ns()}"
    run_id = hashlib.sha256(identity.encode()).hexdigest()[:16]
    stored.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(stored, run_id + "\n")
    return run_id


class MetricsLogger:
    def __init__(self, run_dir: RunDir, cfg: RunConfig, cfg_dict: dict, start_step: int):
        self.log_interval = cfg.train.log_interval
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.flops_per_token = flops_per_token(cfg.model)
        self.peak_tflops = device_peak_tflops()
        self.world_size = dist.get_world_size()
        self.writing = dist.get_rank() == 0
        self.file = self.tb = self.wandb = self.bar = None
        if not self.writing:
            return
        self.file = run_dir.open_metrics()
        log = cfg.logging
        if log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir.tensorboard))
        if log.wandb_mode != "disabled":
            import wandb

            self.wandb = wandb.init(project=log.wandb_project, mode=log.wandb_mode, dir=str(run_dir.path),
                                    config=cfg_dict, resume="allow", id=wandb_run_id(run_dir, cfg),
                                    name=run_dir.path.name)
        if log.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=start_step, unit="step", file=sys.stderr,
                            dynamic_ncols=True)

    def due(self, step: int, skipped: bool) -> bool:
        """Whether `step` is logged: every log_interval steps, and every skipped step. The same on
        every rank, so the loop reduces the loss over ranks only then."""
        return step % self.log_interval == 0 or skipped

    def train_step(self, step: int, loss: float, step_time_s: float, *, skipped: bool, skipped_steps: int,
                   lr: float, grad_norm: Optional[float], trainable_params: int) -> None:
        """Writes the record of a step that is `due`."""
        if not self.writing or not self.due(step, skipped):
            return
        tokens_per_s = self.tokens_per_step / step_time_s
        record = TrainRecord(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s,
                             step_time_s=step_time_s, skipped_steps=skipped_steps,
                             trainable_params=trainable_params, peak_mem_bytes=peak_memory_bytes())
        if self.peak_tflops is not None:
            record.tflops_per_device = self.flops_per_token * tokens_per_s / self.world_size / 1e12
            record.mfu = record.tflops_per_device / self.peak_tflops
        self._write(record)
        if self.bar is not None:  # shown from the next redraw on
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def step_done(self, step: int) -> None:
        """Move the progress bar to `step`; called after every step, logged or not (host only)."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def evaluation(self, step: int, split: str, loss: float) -> None:
        if self.writing:
            self._write(EvalRecord(step=step, split=split, loss=loss, ppl=math.exp(min(loss, 50.0))))

    def _write(self, record: Record) -> None:
        self.file.append(record)
        scalars = {k: v for k, v in asdict(record).items()
                   if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(f"{record.split}/{key}", value, record.step)
        if self.wandb is not None:
            self.wandb.log({f"{record.split}/{k}": v for k, v in scalars.items()}, step=record.step)

    def close(self) -> None:
        for sink in (self.file, self.tb, self.bar):
            if sink is not None:
                sink.close()
        if self.wandb is not None:
            self.wandb.finish()
