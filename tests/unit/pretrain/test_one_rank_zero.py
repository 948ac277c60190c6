"""With one data-parallel rank ZeRO has nothing to partition: an fp32 run trains at ZeRO-0 there
(config.for_world), unless deepspeed.zero_with_one_rank keeps the stage, and the entry hands its
workers (and so the run dir) the stage that runs."""

from __future__ import annotations

import dataclasses

import pytest
from pretrain_runs import arguments, keep_environment, write_config

from pretrain import pretrain_ora
from pretrain.config.run_config import ParallelConfig, RunConfig, for_world, read_run_config
from pretrain.config.runtime_sections import DeepSpeedConfig
from pretrain.training import worker


def config(zero_stage: int, precision: str = "fp32", keep: bool = False, tensor: int = 1) -> RunConfig:
    return dataclasses.replace(RunConfig(), parallel=ParallelConfig(tensor=tensor),
                               deepspeed=DeepSpeedConfig(zero_stage=zero_stage, precision=precision,
                                                         zero_with_one_rank=keep))


@pytest.mark.parametrize("cfg, world_size, stage", [
    (config(1), 1, 0),
    (config(2), 1, 0),
    (config(3), 1, 0),
    (config(1, tensor=2), 2, 0),  # TP2 on two processes: still one data-parallel rank
    (config(1), 2, 1),
    (config(1, tensor=2), 4, 1),
    (config(1, keep=True), 1, 1),
    (config(1, "bf16"), 1, 1),  # ZeRO-0's bf16 optimizer is another wrapper: kept
    (config(2, "fp16"), 1, 2),
])
def test_stage_that_runs(cfg, world_size, stage):
    assert for_world(cfg, world_size).deepspeed.zero_stage == stage


def test_the_entry_hands_workers_the_stage_that_runs(tmp_path, monkeypatch, capsys):
    """The workers read the run dir's config.yaml, resolved before they start."""
    keep_environment(monkeypatch)
    started = []
    monkeypatch.setattr(worker, "train_worker", lambda run_dir, known: started.append(read_run_config(run_dir)) or 0)
    args = arguments(write_config(tmp_path), tmp_path / "run", ["deepspeed.zero_stage=1"], nproc=1)
    assert pretrain_ora.main(args) == 0
    assert [cfg.deepspeed.zero_stage for cfg in started] == [0]
    assert "deepspeed.zero_stage=1 with one data-parallel rank: training at ZeRO-0" in capsys.readouterr().err

    started.clear()
    keep = arguments(write_config(tmp_path), tmp_path / "kept", ["deepspeed.zero_stage=1",
                                                                  "deepspeed.zero_with_one_rank=true"], nproc=1)
    assert pretrain_ora.main(keep) == 0
    assert [cfg.deepspeed.zero_stage for cfg in started] == [1]
    assert "training at ZeRO-0" not in capsys.readouterr().err
