"""The training loop. Its components decide when they act: the metrics logger when to log, the
evaluator when to validate and when early stopping stops, the checkpointer when to save, the step
guard whether a spiking update is applied (train.spike_skip); the hang watchdog watches the loop.

A run of skipped steps (non-finite, or spikes) of train.max_consecutive_skips in a row stops the run,
or, with train.rewind, rewinds it: the newest intact checkpoint saved before the first of them is
loaded again, the train.rewind.skip_batches data batches that end with the divergent ones (those
at least) are skipped, the steps between the checkpoint and them train again on their own batches,
and training goes on; the rewind is recorded in the train state (and so in every later
checkpoint), metrics.jsonl and summary.json.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import signal
import sys
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import get_flattened_grad_norm
from megatron.core import parallel_state

from ora_megatron.attention import use_imported_qk
from ora_megatron.config_io import to_dict
from pretrain.checkpoint import init_from, reshard
from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
from pretrain.checkpoint.consolidate import imported_qk
from pretrain.config import PROCESS_FAULTS, RunConfig
from pretrain.run_dir import RunDir, Summary, step_of_tag
from pretrain.runtime import accounting
from pretrain.runtime.data import BatchOrder, StepBatches, build_datasets, build_tokenizer, document_keys
from pretrain.runtime.ds_internals import base_optimizer, step_grad_norm
from pretrain.runtime.engine import MegatronMPU, TrainEngine, build_engine
from pretrain.runtime.freeze import apply_freeze_stage
from pretrain.runtime.loss import batch_loss, data_parallel_mean
from pretrain.runtime.metrics import IterationTimer, MetricsLogger, layer_grad_norms, layer_grad_norms_due
from pretrain.runtime.spikes import SpikeWindow, StepGuard, guard_steps
from pretrain.supervision import ATTEMPT_VARIABLE, JOB_START_VARIABLE, SUPERVISOR_VARIABLE
from pretrain.training.evaluator import Evaluator
from pretrain.training.watchdog import Watchdog


class TrainingStopped(RuntimeError):
    """The run cannot continue (too many skipped steps in a row, rewinds used up); a checkpoint was
    saved, and `summary` says what the run reached."""

    def __init__(self, message: str, summary: Optional[Summary] = None):
        super().__init__(message)
        self.summary = summary


class Preemption:
    """SIGTERM, SIGINT and SIGUSR1 ask the run to checkpoint and stop at the end of the current step."""

    def __init__(self):
        self.requested = False
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, self._request)

    def _request(self, _signum, _frame) -> None:
        self.requested = True

    def agreed(self, out_of_time: bool = False, save_due: bool = False) -> tuple[bool, bool, bool]:
        """(a stop was asked of any rank, any rank is out of time, any rank's save interval in seconds has
        passed): the same on every rank (one collective)."""
        if dist.get_world_size() == 1:
            return self.requested, out_of_time, save_due
        flags = torch.tensor([float(self.requested), float(out_of_time), float(save_due)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), bool(flags[1].item()), bool(flags[2].item())


def job_start_time() -> float:
    """When this job started (its supervisor's start), else when this process did."""
    value = os.environ.get(JOB_START_VARIABLE)
    return float(value) if value else time.time() - time.monotonic() + _PROCESS_START


_PROCESS_START = time.monotonic()


def attempt_number() -> int:
    """Which launch of the job this process belongs to: 0 for the first, 1 after the first restart."""
    return int(os.environ.get(ATTEMPT_VARIABLE) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, grad_accum: int, watchdog: Optional[Watchdog] = None):
        self.cfg, self.grad_accum, self.watchdog = cfg, grad_accum, watchdog
        datasets = build_datasets(cfg, build_tokenizer(cfg), run_dir.data_cache)
        self.state = TrainState()
        skip = cfg.train.spike_skip
        self.window = SpikeWindow(skip.window, skip.sigma) if skip.enabled else None
        self.guard = StepGuard(self.window, self._step_grad_norm) if self.window else None
        self._step_loss: Optional[float] = None  # the step's data-parallel mean loss, when the guard needed it
        self.train_engine: TrainEngine = build_engine(cfg, grad_accum)
        # Imported Q/K (train.init_from_qk: imported) are the reference frozen ones are restored to.
        use_imported_qk(self.train_engine.module, imported_qk(run_dir))
        self._guard_engine()
        self.param_counts = accounting.parameter_counts(self.train_engine)
        self.grad_bytes: Optional[int] = None  # measured once per trainable set
        self.zero0_grad_norm: Optional[float] = None  # where DeepSpeed has none (TrainEngine.reports_no_grad_norm)
        self.layer_grad_norms: Optional[dict] = None  # of the last step, read before its optimizer step
        self._enter_freeze_stage(cfg.train.freeze_stage_at(0))
        self.batches = StepBatches(datasets, BatchOrder(cfg.train.micro_batch_size, grad_accum, *self._dp_rank_size()),
                                   prefetch=torch.cuda.is_available(), extra_keys=document_keys(cfg))
        self.run_dir = run_dir
        self.checkpointer = Checkpointer(run_dir, cfg.checkpoint)
        restarts = [r for r in run_dir.read_restarts() if r.action == "restart" and r.node_rank in (None, 0)]
        self.restarts, self.hangs = len(restarts), sum(bool(r.hang_dumps) for r in restarts)

    def _dp_rank_size(self) -> tuple[int, int]:
        if self.train_engine.pipelined:
            grid = self.train_engine.ds_engine.grid
            return grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def _enter_freeze_stage(self, index: int) -> None:
        if index != self.state.freeze_stage:
            self.train_engine = apply_freeze_stage(self.cfg, self.train_engine, index, self.grad_accum)
            self._guard_engine()
            self.state.freeze_stage = index
            self.param_counts = accounting.parameter_counts(self.train_engine)
            self.grad_bytes = None

    def _guard_engine(self) -> None:
        """The step guard vetoes the torch optimizer's steps (also of an engine rebuilt by a freeze stage)."""
        if self.guard is not None:
            guard_steps(base_optimizer(self.train_engine.ds_engine), self.guard.skip)

    def _step_grad_norm(self) -> Optional[float]:
        norm = step_grad_norm(self.train_engine.ds_engine)
        return norm if norm is not None else self.zero0_grad_norm

    def resume(self) -> bool:
        """Load the latest checkpoint, if there is one."""
        tag = self.checkpointer.latest()
        if tag is None:
            return False
        self._load(tag)
        return True

    def _load(self, tag: str) -> None:
        saved = self.checkpointer.read_state(tag)
        self._enter_freeze_stage(saved.freeze_stage)  # the optimizer must hold the saved trainable set
        # Written by another topology: the launcher converted it once (pretrain/checkpoint/reshard.py).
        converted = reshard.converted_checkpoint(self.run_dir, tag, self.cfg, dist.get_world_size())
        self.checkpointer.load(self.train_engine, tag, saved, converted)
        self.state = saved
        if self.window is not None:
            self.window.load_state_dict(saved.spike_window)

    def import_weights(self) -> bool:
        """A fresh run's imported weights (train.init_from, converted by the launching process), if any."""
        if self.run_dir.read_init_from() is None:
            return False
        init_from.load_import(self.train_engine, self.run_dir)
        return True

    # ------------------------------------------------------------------ one step
    def _loss_factor(self, step: int, position: int) -> Optional[float]:
        """What injected faults multiply this step's loss by (None: nothing injected)."""
        factor = None
        if step + 1 in self.cfg.train.inject_nonfinite_loss_steps:
            factor = float("nan")
        for fault in self.cfg.train.inject_faults:
            if fault.batch == position + 1:
                factor = (factor or 1.0) * (float("nan") if fault.kind == "nan" else fault.factor)
        return factor

    def _train_step(self, step: int) -> torch.Tensor:
        """One optimizer step; returns this rank's mean loss, left on the device until it is logged."""
        ds_engine = self.train_engine.ds_engine
        position = self.state.data_position(step)
        if self.train_engine.pipelined:
            return ds_engine.train_batch(data_iter=self.batches.pipeline_iter("train", position))
        losses = []
        factor = self._loss_factor(step, position)
        self._step_loss = None
        for micro in range(self.grad_accum):
            loss = batch_loss(ds_engine, self.batches.micro_batch("train", position, micro))
            if factor is not None:
                loss = loss * factor
            last = micro == self.grad_accum - 1
            self.train_engine.backward(loss, last_micro_batch=last)
            losses.append(loss.detach())
            if last:
                if self.grad_bytes is None:  # gradient storage only changes with the trainable set
                    self.grad_bytes = accounting.local_grad_bytes(ds_engine)
                if self.train_engine.reports_no_grad_norm:
                    trainable = self.train_engine.trainable
                    self.zero0_grad_norm = float(get_flattened_grad_norm(trainable, mpu=MegatronMPU()))
                due = layer_grad_norms_due(self.cfg, step + 1)
                self.layer_grad_norms = layer_grad_norms(self.train_engine) if due else None
                if self.guard is not None:  # the same loss on every rank decides the same skip
                    self._step_loss = data_parallel_mean(torch.stack(losses).mean())
                    self.guard.arm(self._step_loss)
            ds_engine.step()
        return torch.stack(losses).mean()

    def _mean_loss(self, loss: torch.Tensor) -> float:
        """The step's loss over the data-parallel ranks (the pipeline engine has reduced it already)."""
        if self._step_loss is not None:
            return self._step_loss
        return loss.item() if self.train_engine.pipelined else data_parallel_mean(loss)

    def _grad_norm(self) -> Optional[float]:
        """None where there is none, or where it is not finite (a skipped step)."""
        norm = self.train_engine.ds_engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else self.zero0_grad_norm
        return norm if norm is not None and math.isfinite(norm) and norm >= 0 else None

    def _inject_process_faults(self, step: int) -> None:
        """Fault injection (train.inject_faults) after `step` was trained, on this rank and attempt."""
        rank, attempt = dist.get_rank(), attempt_number()
        for fault in self.cfg.train.inject_faults:
            if (fault.kind not in PROCESS_FAULTS or fault.step != step or fault.rank != rank
                    or fault.attempt not in (None, attempt)):
                continue
            print(f"injected fault: {fault.kind} on rank {rank} after step {step} (attempt {attempt})",
                  file=sys.stderr, flush=True)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == "preempt":  # as a scheduler would: to the job, which passes it to every rank
                os.kill(int(os.environ.get(SUPERVISOR_VARIABLE) or os.getpid()), signal.SIGTERM)
            else:
                raise RuntimeError(f"injected crash after step {step}")

    # ------------------------------------------------------------------ the loop
    @contextlib.contextmanager
    def _aside(self, timer: IterationTimer) -> Iterator[None]:
        """Work that is no step: not in the step time, not watched for hangs."""
        with timer.paused(), (self.watchdog.paused() if self.watchdog else contextlib.nullcontext()):
            yield

    def train(self) -> Summary:
        logger = MetricsLogger(self.run_dir, self.cfg, to_dict(self.cfg), start_step=self.state.step)
        if attempt_number() > 0 and self.restarts:  # this job restarted: its record, as an event
            restart = [r for r in self.run_dir.read_restarts() if r.action == "restart" and r.node_rank in (None, 0)]
            detail = {k: v for k, v in vars(restart[-1]).items() if k != "log_tail"}
            logger.event(self.state.step, "restart", {**detail, "training_again_at": time.time()})
        try:
            return self._loop(logger, Evaluator(self.cfg, self.batches, logger))
        finally:
            logger.close()

    def _loop(self, logger: MetricsLogger, evaluator: Evaluator) -> Summary:
        cfg, state = self.cfg.train, self.state
        preemption = Preemption()
        job_start = job_start_time()
        # Wall time adds up over segments: a resumed run starts from its checkpoint's.
        segment_start, time_before, train_loss = time.time(), state.train_time_s, float("nan")

        def train_time_s() -> float:
            return time_before + time.time() - segment_start

        stopped_early = preempted = out_of_time = False
        timer, loss, loss_reduced = IterationTimer(), None, False
        longest_step = longest_save = 0.0  # for train.max_wall_time: what the next step and save may take
        last_save = time.monotonic()  # for checkpoint.save_interval_s
        skip_reason: Optional[str] = None
        while state.step < cfg.steps:
            with self._aside(timer):  # an engine rebuild at a freeze-schedule boundary is no step's time
                self._enter_freeze_stage(cfg.freeze_stage_at(state.step))
            self.train_engine.scheduler.step(1)  # lr for this update (megatron's warmup starts at step 1)
            skipped_before = self.train_engine.ds_engine.skipped_steps
            loss = self._train_step(state.step)
            longest_step = max(longest_step, timer.lap())
            skipped = self.train_engine.ds_engine.skipped_steps > skipped_before
            spike = self.guard.take() if self.guard is not None else None
            skip_reason = "non-finite" if skipped else (spike.reason if spike else None)
            state.step += 1
            state.tokens_seen += self.cfg.tokens_per_step
            state.skipped_steps += int(skipped)
            state.spike_skips += int(spike is not None)
            state.consecutive_skips = state.consecutive_skips + 1 if skip_reason else 0
            if self.window is not None:
                state.spike_window = self.window.state_dict()
            loss_reduced = logger.due(state.step, skip_reason is not None)
            if loss_reduced:  # the loss leaves the device (a collective) only when it is logged
                train_loss = self._mean_loss(loss)
                seconds, steps = timer.window()  # the steps since the last record, the device synchronised
                logger.train_step(
                    state.step, train_loss, seconds, window_steps=steps, skipped=skip_reason is not None,
                    skipped_steps=state.skipped_steps,
                    lr=self.train_engine.scheduler.get_lr(self.train_engine.ds_engine.optimizer.param_groups[0]),
                    grad_norm=self.guard.norm if spike else self._grad_norm(),
                    trainable_params=self.param_counts[0], layer_grad_norms=self.layer_grad_norms,
                    skip_reason=skip_reason, spike_skips=state.spike_skips, restarts=self.restarts, hangs=self.hangs,
                    rewinds=len(state.rewinds))
            if spike is not None:
                logger.event(state.step, "spike", {"reason": spike.reason, "value": spike.value, "bound": spike.bound})
            logger.step_done(state.step)
            if self.watchdog is not None:
                self.watchdog.beat(state.step)
            self._inject_process_faults(state.step)
            too_many_skips = state.consecutive_skips >= cfg.max_consecutive_skips
            if too_many_skips and cfg.rewind.enabled and len(state.rewinds) < cfg.rewind.max_rewinds:
                with self._aside(timer):
                    rewound = self._rewind(logger, skip_reason)
                if rewound:
                    state = self.state
                    continue
            with self._aside(timer):
                stopped_early = not too_many_skips and evaluator.after_step(self.train_engine, state)
            time_up = cfg.max_wall_time > 0 and (
                time.time() - job_start + longest_step + longest_save >= cfg.max_wall_time)
            every_s = self.cfg.checkpoint.save_interval_s
            preempted, out_of_time, save_due = preemption.agreed(
                time_up, every_s > 0 and time.monotonic() - last_save >= every_s)
            final = state.step == cfg.steps or too_many_skips or stopped_early or preempted or out_of_time
            state.train_time_s = train_time_s()
            with self._aside(timer):
                started = time.monotonic()
                if self.checkpointer.save_if_due(self.train_engine, state, final=final, by_time=save_due):
                    longest_save, last_save = max(longest_save, time.monotonic() - started), time.monotonic()
            if too_many_skips:
                if loss is not None and not loss_reduced:
                    train_loss = self._mean_loss(loss)
                stop_reason = "diverged" if cfg.rewind.enabled else "skipped steps"
                with self._aside(timer):
                    summary = self._summary(train_loss, None, train_time_s(), stop_reason=stop_reason)
                used = (f"; {len(state.rewinds)} rewinds (train.rewind.max_rewinds) did not help"
                        if cfg.rewind.enabled else "")
                what = ("had non-finite loss or gradients" if skip_reason == "non-finite"
                        else f"were skipped (the last: {skip_reason})")
                raise TrainingStopped(
                    f"{state.consecutive_skips} consecutive steps {what} (step {state.step}){used}; stopped, "
                    f"last good state saved in {self.run_dir.checkpoints}", summary)
            if final:
                break
        if loss is not None and not loss_reduced:
            train_loss = self._mean_loss(loss)  # the last step was not logged
        with self._aside(timer):
            test_loss = None if preempted or out_of_time else evaluator.test(self.train_engine, state.step)
            return self._summary(train_loss, test_loss, train_time_s(), stopped_early=stopped_early,
                                 preempted=preempted, evaluator=evaluator,
                                 stop_reason="max_wall_time" if out_of_time else None)

    def _summary(self, train_loss: float, test_loss: Optional[float], wall_time_s: float, *,
                 stopped_early: bool = False, preempted: bool = False, evaluator: Optional[Evaluator] = None,
                 stop_reason: Optional[str] = None) -> Summary:
        trainable, frozen = self.param_counts
        state = self.state
        return Summary(
            final_train_loss=train_loss, final_valid_loss=evaluator.last_valid_loss if evaluator else None,
            final_test_loss=test_loss, wall_time_s=wall_time_s, steps=state.step, stopped_early=stopped_early,
            preempted=preempted, tokens_seen=state.tokens_seen, skipped_steps=state.skipped_steps,
            trainable_params=trainable, frozen_params=frozen, allocated_by_rank=self._allocated_by_rank(),
            final_valid_loss_by_source=evaluator.last_valid_loss_by_source if evaluator else None,
            final_test_loss_by_source=evaluator.test_loss_by_source if evaluator and test_loss is not None else None,
            stop_reason=stop_reason, spike_skips=state.spike_skips, restarts=self.restarts, hangs=self.hangs,
            rewinds=list(state.rewinds))

    # ------------------------------------------------------------------ rewinds
    def _checkpoint_before(self, step: int) -> Optional[str]:
        """The newest intact checkpoint of a step before `step` (rank 0 checks, every rank gets its answer)."""
        chosen = [None]
        if dist.get_rank() == 0:
            for tag in reversed(self.run_dir.checkpoint_tags()):
                if step_of_tag(tag) < step and not self.run_dir.verify_checkpoint(tag):
                    chosen[0] = tag
                    break
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(chosen, src=0)
        return chosen[0]

    def _rewind(self, logger: MetricsLogger, reason: Optional[str]) -> bool:
        """Reload the newest checkpoint from before the current run of skipped steps and skip the batches
        that led to it; False when there is no such checkpoint (the run then stops)."""
        before, rewind = self.state, self.cfg.train.rewind
        first_skipped_step = before.step - before.consecutive_skips + 1
        tag = self._checkpoint_before(first_skipped_step)
        if tag is None:
            if dist.get_rank() == 0:
                print(f"warning: no intact checkpoint from before step {first_skipped_step} to rewind to",
                      file=sys.stderr, flush=True)
            return False
        back_to = step_of_tag(tag)
        self._load(tag)
        after = self.state
        # The skip_batches batches that end with the divergence's (all of those at least) are skipped; the
        # steps between the checkpoint and them train again on their own batches.
        skip = max(rewind.skip_batches, before.consecutive_skips)
        start = max(back_to, before.step - skip)  # the (0-based) step that reads the first batch after them
        first_batch = after.data_position(start) + 1  # 1-based, as the batches of inject_faults
        record = {"time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  "at_step": before.step, "first_skipped_step": first_skipped_step, "reason": reason,
                  "checkpoint": tag, "back_to_step": back_to, "skipped_batches": [first_batch, first_batch + skip - 1]}
        # Events and time carry over: they happened. The model, its data position and the window are the checkpoint's.
        after.skipped_steps, after.spike_skips = before.skipped_steps, before.spike_skips
        after.train_time_s = before.train_time_s
        after.consecutive_skips = 0
        after.data_skips = [*after.data_skips, [start, skip]]
        after.rewinds = [*before.rewinds, record]
        self.checkpointer.rewound_to(tag, after)
        logger.event(before.step, "rewind", record)
        if dist.get_rank() == 0:
            print(f"rewind {len(after.rewinds)} of {rewind.max_rewinds}: {before.consecutive_skips} steps in a row "
                  f"skipped ({reason}) up to step {before.step}; back to {tag}, skipping data batches "
                  f"{record['skipped_batches'][0]}-{record['skipped_batches'][1]}", file=sys.stderr, flush=True)
        return True

    def _allocated_by_rank(self) -> list[dict]:
        """Every rank's optimizer-state and gradient bytes (a collective)."""
        allocated = [None] * dist.get_world_size()
        dist.all_gather_object(allocated, accounting.allocated_state(self.train_engine.ds_engine, self.grad_bytes))
        return allocated
