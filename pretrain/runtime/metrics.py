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
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad
from megatron.core import parallel_state

from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import LoggingConfig
from pretrain.run_files.run_dir import RunDir, config_hash, write_text_atomic
from pretrain.run_files.run_records import EvalRecord, EventRecord, Record, TrainRecord
from pretrain.runtime.accounting import device_peak_tflops, flops_per_token, peak_memory_bytes
from pretrain.runtime.engine import TrainEngine


class IterationTimer:
    """Wall time of each training iteration: from the end of one train step to the end of the next,
    so it holds the loop's own work too (LR schedule, logging, the preemption check), like nanoGPT's
    per-iteration time; evaluation and checkpoint saves are left out (`paused`), like Megatron-LM's
    interval timer, so a step's throughput does not depend on the cadence of either.

    `window()` adds up the iterations since the previous window, for a logged step's throughput. On a
    GPU the host only queues a step's kernels, so one lap measures their launch, not their run: the
    window waits for the device once (torch.cuda.synchronize), so it covers the device's work of every
    step in it, with one synchronisation per logged step rather than one per step."""

    def __init__(self):
        self._mark = time.perf_counter()
        self._paused = 0.0
        self._window_s, self._window_steps = 0.0, 0

    def lap(self) -> float:
        """Seconds since the previous lap (or the timer's start, or the last window), pauses excluded; the
        iteration joins the current window."""
        now = time.perf_counter()
        elapsed = now - self._mark - self._paused
        self._mark, self._paused = now, 0.0
        self._window_s += elapsed
        self._window_steps += 1
        return elapsed

    def window(self) -> tuple[float, int]:
        """(seconds, iterations) since the previous window: its laps and the time after the last of them (a
        logged step's loss reduction), pauses excluded, once the CUDA device, if this process uses one, has
        finished what was queued. Starts the next window."""
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter()
        seconds, steps = self._window_s + now - self._mark - self._paused, self._window_steps
        self._mark, self._paused = now, 0.0
        self._window_s, self._window_steps = 0.0, 0
        return seconds, steps

    @contextmanager
    def paused(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start


@dataclass(frozen=True)
class Throughput:
    step_time_s: float  # mean over the window
    tokens_per_s: float  # of all ranks together
    tflops_per_device: Optional[float]  # analytic FLOPs (flops_per_token); None where the peak is unknown
    mfu: Optional[float]  # tflops_per_device / the device's dense peak for the run's precision


def throughput(seconds: float, steps: int, tokens_per_step: int, flops_per_token: float, world_size: int,
               peak_tflops: Optional[float]) -> Throughput:
    """Speed over a window of `steps` optimizer steps of `tokens_per_step` tokens (all ranks together)
    that took `seconds`; TFLOP/s and MFU only against a known peak (accounting.device_peak_tflops)."""
    step_time_s = seconds / steps
    tokens_per_s = tokens_per_step / step_time_s
    if peak_tflops is None:
        return Throughput(step_time_s, tokens_per_s, None, None)
    tflops_per_device = flops_per_token * tokens_per_s / world_size / 1e12
    return Throughput(step_time_s, tokens_per_s, tflops_per_device, tflops_per_device / peak_tflops)


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
        self.tokens_per_step = cfg.tokens_per_step
        self.flops_per_token = flops_per_token(cfg.model)
        self.peak_tflops = device_peak_tflops(cfg.deepspeed.precision)
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

    def train_step(self, step: int, loss: float, seconds: float, *, window_steps: int = 1, skipped: bool,
                   skipped_steps: int, lr: float, grad_norm: Optional[float], trainable_params: int,
                   layer_grad_norms: Optional[dict[str, Optional[float]]] = None, skip_reason: Optional[str] = None,
                   spike_skips: int = 0, restarts: int = 0, hangs: int = 0, rewinds: int = 0) -> None:
        """Writes the record of a step that is `due`. `seconds` is the wall time of the `window_steps`
        steps since the previous record (IterationTimer.window), or of this step alone: the record's step
        time, tokens/s, TFLOP/s and MFU are over them (`throughput`). The run's fault counters
        (skipped steps and spikes, restarts, hangs, rewinds) go to the record and, when not zero, to the
        progress bar."""
        if not self.writing or not self.due(step, skipped):
            return
        speed = throughput(seconds, window_steps, self.tokens_per_step, self.flops_per_token, self.world_size,
                           self.peak_tflops)
        record = TrainRecord(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=speed.tokens_per_s,
                             step_time_s=speed.step_time_s, skipped_steps=skipped_steps,
                             trainable_params=trainable_params, peak_mem_bytes=peak_memory_bytes(),
                             tflops_per_device=speed.tflops_per_device, mfu=speed.mfu,
                             layer_grad_norms=layer_grad_norms, skip_reason=skip_reason, spike_skips=spike_skips,
                             restarts=restarts, hangs=hangs, rewinds=rewinds)
        self._write(record)
        if self.bar is not None:  # shown from the next redraw on
            counters = {"skipped": skipped_steps + spike_skips, "restarts": restarts, "hangs": hangs,
                        "rewinds": rewinds}
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{speed.tokens_per_s:,.0f}",
                                 **{k: v for k, v in counters.items() if v}, refresh=False)

    def step_done(self, step: int) -> None:
        """Move the progress bar to `step`; called after every step, logged or not (host only)."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def evaluation(self, step: int, split: str, loss: float, sources: Optional[dict[str, float]] = None) -> None:
        if self.writing:
            self._write(EvalRecord(step=step, split=split, loss=loss, ppl=math.exp(min(loss, 50.0)),
                                   sources=sources or None))

    def event(self, step: int, kind: str, detail: dict) -> None:
        """A restart, rewind or skipped spike: a line of metrics.jsonl and, above the progress bar, of stderr
        (TensorBoard and wandb get the counters of the train records)."""
        if not self.writing:
            return
        self.file.append(EventRecord(step=step, kind=kind, detail=detail))
        if kind != "spike":  # those are counted on the bar
            text = f"{kind} at step {step}: " + ", ".join(f"{k} {v}" for k, v in detail.items()
                                                          if k in ("cause", "reason", "checkpoint", "skipped_batches"))
            (self.bar.write if self.bar is not None else print)(text, file=sys.stderr)

    def _write(self, record: Record) -> None:
        self.file.append(record)
        fields = {}
        for key, value in asdict(record).items():  # a dict field's entries as `field/key` (layer_grad_norms)
            fields.update({f"{key}/{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value})
        scalars = {k: v for k, v in fields.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
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


def layer_grad_norms_due(logging: LoggingConfig, log_interval: int, step: int) -> bool:
    """Whether step `step` (1-based) records per-stage gradient norms: a log-interval step, when asked for."""
    return logging.layer_grad_norms and step % log_interval == 0


def layer_grad_norms(train_engine: TrainEngine) -> Optional[dict[str, Optional[float]]]:
    """The 2-norm of each stage's gradient (`{"embedding": …, "layer1": …, "final_norm": …}`), unscaled,
    before clipping: their root sum of squares is the step's grad_norm. None for a pipeline (its
    engine steps inside train_batch: the gradients are never there to read); None for a stage whose
    norm is not finite (a skipped step).

    Called between a step's last backward and its optimizer step, the one moment every layout holds
    the reduced gradients: in `param.grad` (ZeRO-0), in ZeRO-1/2/3's partitions, read whole through
    DeepSpeed's `safe_get_full_grad` (a collective over the data-parallel group: every rank asks for
    every parameter, in the same order). Tensor-parallel shards are summed over the TP group,
    replicated weights counted once (TP rank 0). fp16 gradients are divided by the loss scale.
    """
    if train_engine.pipelined:
        return None
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    squares: dict[str, torch.Tensor] = {}
    for name, param in train_engine.named_parameters():
        if not param.requires_grad:
            continue
        stage = name.split(".", 1)[0]
        grad = safe_get_full_grad(param)
        total = squares.setdefault(stage, torch.zeros((), dtype=torch.float32, device=param.device))
        if grad is not None and (getattr(param, "tensor_model_parallel", False) or tp_rank == 0):
            total += torch.linalg.vector_norm(grad, dtype=torch.float32).square()
    stacked = torch.stack(list(squares.values()))
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(stacked, group=parallel_state.get_tensor_model_parallel_group())
    scale = float(getattr(train_engine.ds_engine.optimizer, "loss_scale", 1.0))
    norms = (stacked.sqrt() / scale).tolist()
    return {stage: norm if math.isfinite(norm) else None for stage, norm in zip(squares, norms)}
