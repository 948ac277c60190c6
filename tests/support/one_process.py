"""A run's runtime parts in the test's own process: a one-rank gloo group, a tiny RunConfig, and
optimizer steps of the engine pretrain.runtime.engine.build_engine makes of it."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from model_fixtures import tiny_model, tokens

from ora_megatron.parallel import destroy_distributed, init_distributed
from pretrain.config.loop_sections import TrainConfig
from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import LoggingConfig
from pretrain.runtime.loss import lm_loss


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """torch.distributed and megatron-core's parallel state for one rank (gloo), for the block."""
    init_distributed(1, 1, backend="gloo")
    try:
        yield
    finally:
        destroy_distributed()


def tiny_run(variant: str = "ora_qr", **sections) -> RunConfig:
    """model_fixtures' tiny model in a run of micro and global batch 2, writing nothing but
    metrics.jsonl; `sections` replace whole sections (train=TrainConfig(...), checkpoint=...)."""
    cfg = RunConfig(model=tiny_model(variant), train=TrainConfig(micro_batch_size=2, global_batch_size=2, steps=10),
                    logging=LoggingConfig(tensorboard=False, wandb_mode="disabled", progress=False))
    return dataclasses.replace(cfg, **sections)


def optimizer_steps(train_engine, count: int) -> None:
    """`count` optimizer steps of a plain engine (one micro-batch each), LR schedule included."""
    for step in range(count):
        train_engine.scheduler.step(1)
        batch = tokens(step)
        loss = lm_loss(train_engine.ds_engine(batch), (batch, batch.new_ones(batch.shape)))
        train_engine.backward(loss, last_micro_batch=True)
        train_engine.ds_engine.step()
