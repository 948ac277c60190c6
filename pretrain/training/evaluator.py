"""Validation and test loss on a fixed set of batches, and early stopping on the validation loss."""

from __future__ import annotations

from typing import Optional

import torch

from pretrain.checkpoint.checkpointer import TrainState
from pretrain.config.run_config import RunConfig
from pretrain.runtime.data import StepBatches, source_split
from pretrain.runtime.engine import TrainEngine
from pretrain.runtime.loss import batch_loss, data_parallel_mean
from pretrain.runtime.metrics import MetricsLogger


class Evaluator:
    """Validates every eval_interval steps and at the last step; says when early stopping stops.
    With a manifest of several sources each evaluation also measures every source's part of the split
    (the blend's loss, early stopping's, stays the blend's)."""

    def __init__(self, cfg: RunConfig, batches: StepBatches, logger: MetricsLogger):
        self.cfg, self.batches, self.logger = cfg, batches, logger
        self.last_valid_loss: Optional[float] = None
        self.last_valid_loss_by_source: Optional[dict[str, float]] = None
        self.test_loss_by_source: Optional[dict[str, float]] = None

    def source_losses(self, train_engine: TrainEngine, split: str) -> Optional[dict[str, float]]:
        """Each source's loss on its part of `split` (the same eval.iters batches every time), or None."""
        prefix = source_split(split, "")
        keys = [key for key in self.batches.datasets if key.startswith(prefix) and self.batches.has(key)]
        return {key.removeprefix(prefix): self.loss(train_engine, key) for key in keys} or None

    @torch.no_grad()
    def loss(self, train_engine: TrainEngine, split: str) -> Optional[float]:
        """Mean loss over eval.iters global batches of `split` (None if the run has no such split)."""
        if not self.batches.has(split):
            return None
        ds_engine = train_engine.ds_engine
        ds_engine.eval()
        losses = []
        for i in range(self.cfg.eval.iters):
            if train_engine.pipelined:
                losses.append(ds_engine.eval_batch(data_iter=self.batches.pipeline_iter(split, i)).float())
            else:
                losses += [batch_loss(ds_engine, self.batches.micro_batch(split, i, m))
                           for m in range(self.batches.order.grad_accum)]
        ds_engine.train()
        loss = torch.stack(losses).mean()
        return loss.item() if train_engine.pipelined else data_parallel_mean(loss)

    def after_step(self, train_engine: TrainEngine, state: TrainState) -> bool:
        """Validate if due; True when early stopping says stop (its counters live in `state`)."""
        if not self.cfg.train.evaluates_at(state.step):
            return False
        loss = self.loss(train_engine, "valid")
        if loss is None:
            return False
        self.last_valid_loss, self.last_valid_loss_by_source = loss, self.source_losses(train_engine, "valid")
        self.logger.evaluation(state.step, "valid", loss, self.last_valid_loss_by_source)
        early = self.cfg.eval.early_stopping
        if loss < state.best_valid_loss - early.min_delta:
            state.best_valid_loss, state.evals_without_improvement = loss, 0
        else:
            state.evals_without_improvement += 1
        return early.enabled and state.evals_without_improvement >= early.patience

    def test(self, train_engine: TrainEngine, step: int) -> Optional[float]:
        loss = self.loss(train_engine, "test")
        if loss is not None:
            self.test_loss_by_source = self.source_losses(train_engine, "test")
            self.logger.evaluation(step, "test", loss, self.test_loss_by_source)
        return loss
