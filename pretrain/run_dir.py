"""A run directory as a typed API: the only module that knows its file names and formats.

    run_dir/
      config.yaml  ds_config.json  versions.json     resolved config, DeepSpeed JSON, versions + git
      metrics.jsonl                                  one TrainRecord / EvalRecord per line (rank 0)
      summary.json                                   Summary of the finished (or stopped) run
      checkpoints/latest                             tag of the newest complete checkpoint
      checkpoints/step00001000/                      DeepSpeed files, train_state.json, rng_rank{r}.pt
      tensorboard/  wandb/  data_cache/

The entry point, the trainer, the metrics logger, benchmarks, sweeps and tests read and write a
run through `RunDir`, so a layout change happens here only.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional, Union

TAG_PATTERN = re.compile(r"step(\d{8})")


def checkpoint_tag(step: int) -> str:
    return f"step{step:08d}"


def step_of_tag(tag: str) -> int:
    match = TAG_PATTERN.fullmatch(tag)
    if match is None:
        raise ValueError(f"not a checkpoint tag: {tag!r}")
    return int(match.group(1))


@dataclass
class TrainRecord:
    """One logged training step."""

    step: int
    loss: float
    lr: float
    grad_norm: Optional[float]
    tokens_per_s: float
    step_time_s: float
    skipped_steps: int
    trainable_params: int
    peak_mem_bytes: int  # GPU: allocator peak; CPU: process max RSS
    tflops_per_device: Optional[float] = None  # on a GPU whose peak is known
    mfu: Optional[float] = None
    split: str = "train"


@dataclass
class EvalRecord:
    """Loss and perplexity on the validation set (every eval_interval) or the test set (at the end)."""

    step: int
    split: str  # "valid" or "test"
    loss: float
    ppl: float


Record = Union[TrainRecord, EvalRecord]


@dataclass
class Summary:
    """What a finished, stopped-early or preempted run reports."""

    final_train_loss: float
    final_valid_loss: Optional[float]
    final_test_loss: Optional[float]  # None when preempted or without a test split
    wall_time_s: float
    steps: int
    stopped_early: bool
    preempted: bool
    tokens_seen: int
    skipped_steps: int
    trainable_params: int
    frozen_params: int
    # Per rank: Adam-state elements/bytes and gradient bytes, read from the live tensors.
    allocated_by_rank: list[dict] = field(default_factory=list)


def _from_json(data: dict) -> Record:
    cls = TrainRecord if data["split"] == "train" else EvalRecord
    return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


class MetricsFile:
    """metrics.jsonl opened for appending (a resumed run continues it), one record a line."""

    def __init__(self, path: Path):
        self._file = open(path, "a")

    def append(self, record: Record) -> None:
        self._file.write(json.dumps(asdict(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_text_atomic(path: Path, text: str) -> None:
    """Write then rename: readers see the old file or the new one, never a partial one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Entry:
    """A fixed file or folder of a run dir: `RunDir(p).metrics` is `p / "metrics.jsonl"`."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, run_dir: "RunDir", owner):
        return self if run_dir is None else run_dir.path / self.name


class RunDir:
    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ------------------------------------------------------------------ paths
    config = _Entry("config.yaml")
    ds_config = _Entry("ds_config.json")
    versions = _Entry("versions.json")
    metrics = _Entry("metrics.jsonl")
    summary = _Entry("summary.json")
    checkpoints = _Entry("checkpoints")
    tensorboard = _Entry("tensorboard")
    data_cache = _Entry("data_cache")

    def checkpoint(self, tag: str) -> Path:
        return self.checkpoints / tag

    def train_state_file(self, tag: str) -> Path:
        return self.checkpoint(tag) / "train_state.json"

    def rng_state_file(self, tag: str, rank: int) -> Path:
        return self.checkpoint(tag) / f"rng_rank{rank}.pt"

    # ------------------------------------------------------------------ checkpoints
    @property
    def _latest_pointer(self) -> Path:
        return self.checkpoints / "latest"

    def latest_checkpoint(self) -> Optional[str]:
        """Tag of the newest complete checkpoint (the `latest` pointer), or None."""
        pointer = self._latest_pointer
        return pointer.read_text().strip() if pointer.exists() else None

    def set_latest_checkpoint(self, tag: str) -> None:
        write_text_atomic(self._latest_pointer, tag)

    def checkpoint_tags(self) -> list[str]:
        """Every checkpoint directory, oldest first (complete or not)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(p.name for p in self.checkpoints.iterdir() if p.is_dir() and TAG_PATTERN.fullmatch(p.name))

    def read_train_state(self, tag: str) -> dict:
        return json.loads(self.train_state_file(tag).read_text())

    def write_train_state(self, tag: str, state: dict) -> None:
        write_text_atomic(self.train_state_file(tag), json.dumps(state, indent=2))

    # ------------------------------------------------------------------ run files
    def write_run_files(self, config: dict, ds_config: dict, versions: dict) -> None:
        import yaml

        self.path.mkdir(parents=True, exist_ok=True)
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.ds_config.write_text(json.dumps(ds_config, indent=2) + "\n")
        self.versions.write_text(json.dumps(versions, indent=2) + "\n")

    def read_config(self):
        """The run's resolved config as a typed RunConfig."""
        from pretrain.config import load_run_config

        return load_run_config(str(self.config))

    # ------------------------------------------------------------------ metrics and summary
    def open_metrics(self) -> MetricsFile:
        return MetricsFile(self.metrics)

    def read_records(self, split: Optional[str] = None) -> list[Record]:
        if not self.metrics.exists():
            return []
        records = [_from_json(json.loads(line)) for line in self.metrics.read_text().splitlines() if line]
        return [r for r in records if split is None or r.split == split]

    def write_summary(self, summary: Summary) -> None:
        write_text_atomic(self.summary, json.dumps(asdict(summary), indent=2, default=float) + "\n")

    def read_summary(self) -> Summary:
        return Summary(**json.loads(self.summary.read_text()))
