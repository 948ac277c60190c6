"""The training loop. Its components decide when they act: the metrics logger when to log, the
evaluator when to validate and when early stopping stops, the checkpointer when to save."""

from __future__ import annotations

import math
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import get_flattened_grad_norm
from megatron.core import parallel_state

from ora_megatron.attention import use_imported_qk
from ora_megatron.config_io import to_dict
from pretrain.checkpoint import init_from, reshard
from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
from pretrain.checkpoint.consolidate import imported_qk
from pretrain.config import RunConfig
from pretrain.run_dir import RunDir, Summary
from pretrain.runtime import accounting
from pretrain.runtime.data import BatchOrder, StepBatches, build_datasets, build_tokenizer, document_keys
from pretrain.runtime.engine import MegatronMPU, TrainEngine, build_engine
from pretrain.runtime.freeze import apply_freeze_stage
from pretrain.runtime.loss import batch_loss, data_parallel_mean
from pretrain.runtime.metrics import IterationTimer, MetricsLogger, layer_grad_norms, layer_grad_norms_due
from pretrain.training.evaluator import Evaluator


class TrainingStopped(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite steps); a checkpoint was saved."""


class Preemption:
    """SIGTERM/SIGINT ask the run to checkpoint and stop at the end of the current step."""

    def __init__(self):
        self.requested = False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request)

    def _request(self, _signum, _frame) -> None:
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank once any rank was asked to stop (a collective)."""
        if dist.get_world_size() == 1:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, grad_accum: int):
        self.cfg, self.grad_accum = cfg, grad_accum
        datasets = build_datasets(cfg, build_tokenizer(cfg), run_dir.data_cache)
        self.state = TrainState()
        self.train_engine: TrainEngine = build_engine(cfg, grad_accum)
        # Imported Q/K (train.init_from_qk: imported) are the reference frozen ones are restored to.
        use_imported_qk(self.train_engine.module, imported_qk(run_dir))
        self.param_counts = accounting.parameter_counts(self.train_engine)
        self.grad_bytes: Optional[int] = None  # measured once per trainable set
        self.zero0_grad_norm: Optional[float] = None  # where DeepSpeed has none (TrainEngine.reports_no_grad_norm)
        self.layer_grad_norms: Optional[dict] = None  # of the last step, read before its optimizer step
        self._enter_freeze_stage(cfg.train.freeze_stage_at(0))
        self.batches = StepBatches(datasets, BatchOrder(cfg.train.micro_batch_size, grad_accum, *self._dp_rank_size()),
                                   prefetch=torch.cuda.is_available(), extra_keys=document_keys(cfg))
        self.run_dir = run_dir
        self.checkpointer = Checkpointer(run_dir, cfg.checkpoint)

    def _dp_rank_size(self) -> tuple[int, int]:
        if self.train_engine.pipelined:
            grid = self.train_engine.ds_engine.grid
            return grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def _enter_freeze_stage(self, index: int) -> None:
        if index != self.state.freeze_stage:
            self.train_engine = apply_freeze_stage(self.cfg, self.train_engine, index, self.grad_accum)
            self.state.freeze_stage = index
            self.param_counts = accounting.parameter_counts(self.train_engine)
            self.grad_bytes = None

    def resume(self) -> bool:
        """Load the latest checkpoint, if there is one."""
        tag = self.checkpointer.latest()
        if tag is None:
            return False
        saved = self.checkpointer.read_state(tag)
        self._enter_freeze_stage(saved.freeze_stage)  # the optimizer must hold the saved trainable set
        # Written by another topology: the launcher converted it once (pretrain/checkpoint/reshard.py).
        converted = reshard.converted_checkpoint(self.run_dir, tag, self.cfg, dist.get_world_size())
        self.checkpointer.load(self.train_engine, tag, saved, converted)
        self.state = saved
        return True

    def import_weights(self) -> bool:
        """A fresh run's imported weights (train.init_from, converted by the launching process), if any."""
        if self.run_dir.read_init_from() is None:
            return False
        init_from.load_import(self.train_engine, self.run_dir)
        return True

    # ------------------------------------------------------------------ one step
    def _train_step(self, step: int) -> torch.Tensor:
        """One optimizer step; returns this rank's mean loss, left on the device until it is logged."""
        ds_engine = self.train_engine.ds_engine
        if self.train_engine.pipelined:
            return ds_engine.train_batch(data_iter=self.batches.pipeline_iter("train", step))
        losses = []
        poison = step + 1 in self.cfg.train.inject_nonfinite_loss_steps
        for micro in range(self.grad_accum):
            loss = batch_loss(ds_engine, self.batches.micro_batch("train", step, micro))
            if poison:
                loss = loss * float("nan")
            last = micro == self.grad_accum - 1
            self.train_engine.backward(loss, last_micro_batch=last)
            if last:
                if self.grad_bytes is None:  # gradient storage only changes with the trainable set
                    self.grad_bytes = accounting.local_grad_bytes(ds_engine)
                if self.train_engine.reports_no_grad_norm:
                    trainable = self.train_engine.trainable
                    self.zero0_grad_norm = float(get_flattened_grad_norm(trainable, mpu=MegatronMPU()))
                due = layer_grad_norms_due(self.cfg, step + 1)
                self.layer_grad_norms = layer_grad_norms(self.train_engine) if due else None
            ds_engine.step()
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    def _mean_loss(self, loss: torch.Tensor) -> float:
        """The step's loss over the data-parallel ranks (the pipeline engine has reduced it already)."""
        return loss.item() if self.train_engine.pipelined else data_parallel_mean(loss)

    def _grad_norm(self) -> Optional[float]:
        """None where there is none, or where it is not finite (a skipped step)."""
        norm = self.train_engine.ds_engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else self.zero0_grad_norm
        return norm if norm is not None and math.isfinite(norm) and norm >= 0 else None

    # ------------------------------------------------------------------ the loop
    def train(self) -> Summary:
        logger = MetricsLogger(self.run_dir, self.cfg, to_dict(self.cfg), start_step=self.state.step)
        try:
            return self._loop(logger, Evaluator(self.cfg, self.batches, logger))
        finally:
            logger.close()

    def _loop(self, logger: MetricsLogger, evaluator: Evaluator) -> Summary:
        cfg, state = self.cfg.train, self.state
        preemption = Preemption()
        # Wall time adds up over segments: a resumed run starts from its checkpoint's.
        segment_start, time_before, train_loss = time.time(), state.train_time_s, float("nan")

        def train_time_s() -> float:
            return time_before + time.time() - segment_start

        stopped_early = preempted = False
        timer, loss, loss_reduced = IterationTimer(), None, False
        while state.step < cfg.steps:
            with timer.paused():  # an engine rebuild at a freeze-schedule boundary is no step's time
                self._enter_freeze_stage(cfg.freeze_stage_at(state.step))
            self.train_engine.scheduler.step(1)  # lr for this update (megatron's warmup starts at step 1)
            skipped_before = self.train_engine.ds_engine.skipped_steps
            loss = self._train_step(state.step)
            timer.lap()
            skipped = self.train_engine.ds_engine.skipped_steps > skipped_before
            state.step += 1
            state.tokens_seen += self.cfg.tokens_per_step
            state.skipped_steps += int(skipped)
            state.consecutive_skips = state.consecutive_skips + 1 if skipped else 0
            loss_reduced = logger.due(state.step, skipped)
            if loss_reduced:  # the loss leaves the device (a collective) only when it is logged
                train_loss = self._mean_loss(loss)
                seconds, steps = timer.window()  # the steps since the last record, the device synchronised
                logger.train_step(
                    state.step, train_loss, seconds, window_steps=steps, skipped=skipped,
                    skipped_steps=state.skipped_steps,
                    lr=self.train_engine.scheduler.get_lr(self.train_engine.ds_engine.optimizer.param_groups[0]),
                    grad_norm=self._grad_norm(), trainable_params=self.param_counts[0],
                    layer_grad_norms=self.layer_grad_norms)
            logger.step_done(state.step)
            too_many_skips = state.consecutive_skips >= cfg.max_consecutive_skips
            with timer.paused():
                stopped_early = not too_many_skips and evaluator.after_step(self.train_engine, state)
            preempted = preemption.agreed()
            final = state.step == cfg.steps or too_many_skips or stopped_early or preempted
            state.train_time_s = train_time_s()
            with timer.paused():
                self.checkpointer.save_if_due(self.train_engine, state, final=final)
            if too_many_skips:
                raise TrainingStopped(
                    f"{state.consecutive_skips} consecutive steps had non-finite loss or gradients "
                    f"(step {state.step}); stopped, last good state saved in {self.run_dir.checkpoints}")
            if final:
                break
        if loss is not None and not loss_reduced:
            train_loss = self._mean_loss(loss)  # the last step was not logged
        test_loss = None if preempted else evaluator.test(self.train_engine, state.step)
        trainable, frozen = self.param_counts
        return Summary(
            final_train_loss=train_loss, final_valid_loss=evaluator.last_valid_loss, final_test_loss=test_loss,
            wall_time_s=train_time_s(), steps=state.step, stopped_early=stopped_early,
            preempted=preempted, tokens_seen=state.tokens_seen, skipped_steps=state.skipped_steps,
            trainable_params=trainable, frozen_params=frozen, allocated_by_rank=self._allocated_by_rank(),
            final_valid_loss_by_source=evaluator.last_valid_loss_by_source,
            final_test_loss_by_source=None if preempted else evaluator.test_loss_by_source)

    def _allocated_by_rank(self) -> list[dict]:
        """Every rank's optimizer-state and gradient bytes (a collective)."""
        allocated = [None] * dist.get_world_size()
        dist.all_gather_object(allocated, accounting.allocated_state(self.train_engine.ds_engine, self.grad_bytes))
        return allocated
