"""The training loop. Its components decide when they act: the metrics logger when to log, the
evaluator when to validate and when early stopping stops, the checkpointer when to save, the step
guard whether a spiking update is applied (stability.spike_skip), `stops` when a signal or the wall
time ends the run; the hang watchdog watches the loop, and the run's faults (pretrain/job/faults.py, tests
only) get one call before and one after each step.

A run of skipped steps (non-finite, or spikes) of stability.max_consecutive_skips in a row stops the
run, or, with stability.rewind, rewinds it: the newest intact checkpoint saved before the first of
them is loaded again, the stability.rewind.skip_batches data batches that end with the divergent ones
(those at least) are skipped, the steps between the checkpoint and them train again on their own
batches, and training goes on; the rewind is recorded in the train state (and so in every later
checkpoint), metrics.jsonl and summary.json.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import get_flattened_grad_norm

from ora_megatron.attention import use_imported_qk
from ora_megatron.config_io import to_dict
from pretrain.checkpoint import reshard
from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
from pretrain.checkpoint.consolidate import imported_qk
from pretrain.config.run_config import RunConfig
from pretrain.job.faults import Faults
from pretrain.job.supervision import attempt_number, job_restarts
from pretrain.run_files.run_dir import RunDir, step_of_tag
from pretrain.run_files.run_records import Summary
from pretrain.runtime import accounting
from pretrain.runtime.data import BatchOrder, StepBatches, build_datasets, build_tokenizer, document_keys
from pretrain.runtime.ds_internals import step_grad_norm
from pretrain.runtime.engine import MegatronMPU, TrainEngine, build_engine
from pretrain.runtime.freeze import apply_freeze_stage
from pretrain.runtime.loss import batch_loss, data_parallel_mean
from pretrain.runtime.metrics import IterationTimer, MetricsLogger, layer_grad_norms, layer_grad_norms_due
from pretrain.runtime.step_guard import Spike, SpikeWindow, StepGuard
from pretrain.training.evaluator import Evaluator
from pretrain.training.stops import Preemption, WallClock
from pretrain.training.watchdog import Watchdog


class TrainingStopped(RuntimeError):
    """The run cannot continue (too many skipped steps in a row, rewinds used up); a checkpoint was
    saved, and `summary` says what the run reached."""

    def __init__(self, message: str, summary: Optional[Summary] = None):
        super().__init__(message)
        self.summary = summary


@dataclass
class StepOutcome:
    """One trained step: this rank's mean loss (left on the device until it is logged), the data-parallel
    mean once it was, and why the step's update was not applied."""

    loss: torch.Tensor
    skip_reason: Optional[str]  # "non-finite", a spike's reason, or None: applied
    spike: Optional[Spike]
    mean_loss: Optional[float] = None


@dataclass
class Ending:
    """What the checks after a step decided."""

    stopped_early: bool = False
    preempted: bool = False
    out_of_time: bool = False
    final: bool = False  # the loop ends after this step


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, grad_accum: int, watchdog: Optional[Watchdog] = None):
        self.cfg, self.run_dir, self.grad_accum, self.watchdog = cfg, run_dir, grad_accum, watchdog
        self.checkpointer = Checkpointer(run_dir, cfg.checkpoint)
        datasets = build_datasets(cfg, build_tokenizer(cfg.data, cfg.model.vocab_size), run_dir.data_cache)
        self.state = TrainState()
        skip = cfg.stability.spike_skip
        self.window = SpikeWindow(skip.window, skip.sigma) if skip.enabled else None
        self.guard = StepGuard(self.window, self._step_grad_norm) if self.window else None
        self._step_loss: Optional[float] = None  # the step's data-parallel mean loss, when the guard needed it
        # The step guard vetoes the torch optimizer's steps (also of an engine rebuilt by a freeze stage).
        self.step_veto = self.guard.skip if self.guard else None
        self.train_engine: TrainEngine = build_engine(cfg, grad_accum, step_veto=self.step_veto)
        self.param_counts = accounting.parameter_counts(self.train_engine)
        # Imported Q/K (init_from.qk: imported) are the reference frozen ones are restored to.
        use_imported_qk(self.train_engine.module, imported_qk(run_dir))
        self.grad_bytes: Optional[int] = None  # measured once per trainable set
        self.zero0_grad_norm: Optional[float] = None  # where DeepSpeed has none (TrainEngine.reports_no_grad_norm)
        self.layer_grad_norms: Optional[dict] = None  # of the last step, read before its optimizer step
        self._enter_freeze_stage(cfg.freeze.stage_at(0, cfg.train.steps))
        rank, layout = dist.get_rank(), self.train_engine.layout
        order = BatchOrder(cfg.train.micro_batch_size, grad_accum, layout.data_rank(rank), layout.data)
        self.batches = StepBatches(datasets, order, prefetch=torch.cuda.is_available(),
                                   extra_keys=document_keys(cfg.data))
        self.attempt = attempt_number()
        self.faults = Faults(cfg.faults, rank, self.attempt)
        self.restarts = job_restarts(run_dir)
        self.hangs = sum(bool(r.hang_dumps) for r in self.restarts)

    def _enter_freeze_stage(self, index: int) -> None:
        if index != self.state.freeze_stage:
            self.train_engine = apply_freeze_stage(self.cfg, self.train_engine, index, self.grad_accum, self.step_veto)
            self.state.freeze_stage = index
            self.param_counts = accounting.parameter_counts(self.train_engine)
            self.grad_bytes = None

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
        # Written by another topology: converted once before the workers started (pretrain/checkpoint/reshard.py).
        converted = reshard.converted_checkpoint(self.run_dir, tag, self.cfg, dist.get_world_size())
        self.checkpointer.load(self.train_engine, tag, saved, converted)
        self.state = saved
        if self.window is not None:
            self.window.load_state_dict(saved.spike_window)

    def import_weights(self) -> bool:
        """A fresh run's imported weights (init_from.path, converted before the workers started), if any."""
        if self.run_dir.read_init_from() is None:
            return False
        from safetensors.torch import load_file

        reshard.load_weights(self.train_engine, load_file(str(self.run_dir.init_from_weights)))
        return True

    # ------------------------------------------------------------------ one step
    def _train_step(self, step: int) -> torch.Tensor:
        """One optimizer step; returns this rank's mean loss, left on the device until it is logged."""
        ds_engine = self.train_engine.ds_engine
        position = self.state.data_position(step)
        if self.train_engine.pipelined:
            return ds_engine.train_batch(data_iter=self.batches.pipeline_iter("train", position))
        losses = []
        factor = self.faults.loss_factor(position + 1)
        self._step_loss = None
        for micro in range(self.grad_accum):
            loss = batch_loss(ds_engine, self.batches.micro_batch("train", position, micro))
            if factor is not None:
                loss = loss * factor
            last = micro == self.grad_accum - 1
            self.train_engine.backward(loss, last_micro_batch=last)
            losses.append(loss.detach())
            if last:
                self._before_optimizer_step(step, losses)
            ds_engine.step()
        return torch.stack(losses).mean()

    def _before_optimizer_step(self, step: int, losses: list[torch.Tensor]) -> None:
        """What is read of the gradients before the last micro-batch's optimizer step changes them."""
        ds_engine = self.train_engine.ds_engine
        if self.grad_bytes is None:  # gradient storage only changes with the trainable set
            self.grad_bytes = accounting.local_grad_bytes(ds_engine)
        if self.train_engine.reports_no_grad_norm:
            self.zero0_grad_norm = float(get_flattened_grad_norm(self.train_engine.trainable, mpu=MegatronMPU()))
        due = layer_grad_norms_due(self.cfg.logging, self.cfg.train.log_interval, step + 1)
        self.layer_grad_norms = layer_grad_norms(self.train_engine) if due else None
        if self.guard is not None:  # the same loss on every rank decides the same skip
            self._step_loss = data_parallel_mean(torch.stack(losses).mean())
            self.guard.arm(self._step_loss)

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

    # ------------------------------------------------------------------ the loop
    @contextlib.contextmanager
    def _aside(self, timer: IterationTimer) -> Iterator[None]:
        """Work that is no step: not in the step time, not watched for hangs."""
        with timer.paused(), (self.watchdog.paused() if self.watchdog else contextlib.nullcontext()):
            yield

    def train(self) -> Summary:
        logger = MetricsLogger(self.run_dir, self.cfg, to_dict(self.cfg), start_step=self.state.step)
        if self.attempt > 0 and self.restarts:  # this job restarted: its record, as an event
            detail = {k: v for k, v in vars(self.restarts[-1]).items() if k != "log_tail"}
            logger.event(self.state.step, "restart", {**detail, "training_again_at": time.time()})
        try:
            return self._loop(logger, Evaluator(self.cfg, self.batches, logger))
        finally:
            logger.close()

    def _loop(self, logger: MetricsLogger, evaluator: Evaluator) -> Summary:
        cfg = self.cfg
        preemption = Preemption()
        clock = WallClock(self.state.train_time_s, cfg.supervision.max_wall_time, cfg.checkpoint.save_interval_s)
        timer, outcome, ending = IterationTimer(), None, Ending()
        while self.state.step < cfg.train.steps:
            outcome = self._step(timer, clock)
            self._record(outcome, timer, logger)
            self.faults.after_step(self.state.step)
            diverged = self.state.consecutive_skips >= cfg.stability.max_consecutive_skips
            if diverged and self._may_rewind():
                with self._aside(timer):
                    rewound = self._rewind(logger, outcome.skip_reason)
                if rewound:
                    continue
            ending = self._after_step(timer, clock, evaluator, preemption, diverged)
            if diverged:
                raise self._stopped(outcome, timer, clock)
            if ending.final:
                break
        train_loss = self._final_loss(outcome)
        with self._aside(timer):
            out = ending.preempted or ending.out_of_time
            test_loss = None if out else evaluator.test(self.train_engine, self.state.step)
            return self._summary(train_loss, test_loss, clock.train_time_s(), stopped_early=ending.stopped_early,
                                 preempted=ending.preempted, evaluator=evaluator,
                                 stop_reason="max_wall_time" if ending.out_of_time else None)

    def _step(self, timer: IterationTimer, clock: WallClock) -> StepOutcome:
        """Train one step and count it in the train state."""
        with self._aside(timer):  # an engine rebuild at a freeze-schedule boundary is no step's time
            self._enter_freeze_stage(self.cfg.freeze.stage_at(self.state.step, self.cfg.train.steps))
        ds_engine = self.train_engine.ds_engine
        self.train_engine.scheduler.step(1)  # lr for this update (megatron's warmup starts at step 1)
        skipped_before = ds_engine.skipped_steps
        loss = self._train_step(self.state.step)
        clock.step_took(timer.lap())
        skipped = ds_engine.skipped_steps > skipped_before
        spike = self.guard.take() if self.guard is not None else None
        outcome = StepOutcome(loss, "non-finite" if skipped else (spike.reason if spike else None), spike)
        state = self.state
        state.step += 1
        state.tokens_seen += self.cfg.tokens_per_step
        state.skipped_steps += int(skipped)
        state.spike_skips += int(spike is not None)
        state.consecutive_skips = state.consecutive_skips + 1 if outcome.skip_reason else 0
        if self.window is not None:
            state.spike_window = self.window.state_dict()
        return outcome

    def _record(self, outcome: StepOutcome, timer: IterationTimer, logger: MetricsLogger) -> None:
        """Log the step when due: its loss leaves the device (a collective) only then."""
        state, skipped = self.state, outcome.skip_reason is not None
        if logger.due(state.step, skipped):
            outcome.mean_loss = self._mean_loss(outcome.loss)
            seconds, steps = timer.window()  # the steps since the last record, the device synchronised
            logger.train_step(
                state.step, outcome.mean_loss, seconds, window_steps=steps, skipped=skipped,
                skipped_steps=state.skipped_steps,
                lr=self.train_engine.scheduler.get_lr(self.train_engine.ds_engine.optimizer.param_groups[0]),
                grad_norm=self.guard.norm if outcome.spike else self._grad_norm(),
                trainable_params=self.param_counts[0], layer_grad_norms=self.layer_grad_norms,
                skip_reason=outcome.skip_reason, spike_skips=state.spike_skips, restarts=len(self.restarts),
                hangs=self.hangs, rewinds=len(state.rewinds))
        if outcome.spike is not None:
            spike = outcome.spike
            logger.event(state.step, "spike", {"reason": spike.reason, "value": spike.value, "bound": spike.bound})
        logger.step_done(state.step)
        if self.watchdog is not None:
            self.watchdog.beat(state.step)

    def _after_step(self, timer: IterationTimer, clock: WallClock, evaluator: Evaluator, preemption: Preemption,
                    diverged: bool) -> Ending:
        """Evaluate, agree on stopping (a signal, the wall time) and save as due."""
        state = self.state
        with self._aside(timer):
            stopped_early = not diverged and evaluator.after_step(self.train_engine, state)
        preempted, out_of_time, save_due = preemption.agreed(clock.out_of_time(), clock.save_due())
        final = state.step == self.cfg.train.steps or diverged or stopped_early or preempted or out_of_time
        state.train_time_s = clock.train_time_s()
        with self._aside(timer):
            started = time.monotonic()
            if self.checkpointer.save_if_due(self.train_engine, state, final=final, by_time=save_due):
                clock.saved(time.monotonic() - started)
        return Ending(stopped_early, preempted, out_of_time, final)

    def _final_loss(self, outcome: Optional[StepOutcome]) -> float:
        """The last step's data-parallel mean loss (reduced now if it was not logged); NaN without a step."""
        if outcome is None:
            return float("nan")
        return outcome.mean_loss if outcome.mean_loss is not None else self._mean_loss(outcome.loss)

    def _stopped(self, outcome: StepOutcome, timer: IterationTimer, clock: WallClock) -> TrainingStopped:
        """Too many skipped steps in a row, with no rewind left: the run stops (its checkpoint is saved)."""
        state, rewind = self.state, self.cfg.stability.rewind
        train_loss = self._final_loss(outcome)
        with self._aside(timer):
            summary = self._summary(train_loss, None, clock.train_time_s(),
                                    stop_reason="diverged" if rewind.enabled else "skipped steps")
        used = (f"; {len(state.rewinds)} rewinds (stability.rewind.max_rewinds) did not help"
                if rewind.enabled else "")
        what = ("had non-finite loss or gradients" if outcome.skip_reason == "non-finite"
                else f"were skipped (the last: {outcome.skip_reason})")
        return TrainingStopped(
            f"{state.consecutive_skips} consecutive steps {what} (step {state.step}){used}; stopped, "
            f"last good state saved in {self.run_dir.checkpoints}", summary)

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
            stop_reason=stop_reason, spike_skips=state.spike_skips, restarts=len(self.restarts), hangs=self.hangs,
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

    def _may_rewind(self) -> bool:
        rewind = self.cfg.stability.rewind
        return rewind.enabled and len(self.state.rewinds) < rewind.max_rewinds

    def _rewind(self, logger: MetricsLogger, reason: Optional[str]) -> bool:
        """Reload the newest checkpoint from before the current run of skipped steps and skip the batches
        that led to it; False when there is no such checkpoint (the run then stops)."""
        before, rewind = self.state, self.cfg.stability.rewind
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
        first_batch = after.data_position(start) + 1  # 1-based, as the batches of a loss fault
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
