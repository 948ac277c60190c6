"""A run directory as a typed API: the only module that knows its file names and formats.

    run_dir/
      config.yaml  ds_config.json  versions.json     resolved config, DeepSpeed JSON, versions + git
      metrics.jsonl                                  one TrainRecord / EvalRecord per line (rank 0)
      summary.json                                   Summary of the finished (or stopped) run
      resume_log.jsonl                               one line per resume: checkpoint, skipped ones, config changes
      experiment.yaml                                ExperimentRecord of a sweep run (pretrain/sweep.py)
      checkpoints/latest                             tag of the newest complete checkpoint
      checkpoints/step00001000/                      DeepSpeed files, train_state.json, rng_rank{r}.pt,
                                                     integrity.json (size + sha256 of every other file)
      tensorboard/  wandb/  data_cache/

The entry point, the trainer, the metrics logger, benchmarks, sweeps and tests read and write a
run through `RunDir`, so a layout change happens here only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional, Union

TAG_PATTERN = re.compile(r"step(\d{8})")
RNG_STATE_PATTERN = re.compile(r"rng_rank(\d+)\.pt")


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
    wall_time_s: float  # the training loop's, summed over the run's segments (resumes add to it)
    steps: int
    stopped_early: bool
    preempted: bool
    tokens_seen: int
    skipped_steps: int
    trainable_params: int
    frozen_params: int
    # Per rank: Adam-state elements/bytes and gradient bytes, read from the live tensors.
    allocated_by_rank: list[dict] = field(default_factory=list)


@dataclass
class ExperimentRecord:
    """The research plan's record of one sweep run: which arm and seed, what it ran, what came out.
    Written by pretrain.sweep before the run starts (status "running") and again when it ends."""

    experiment_id: str  # "<spec>/<arm>/seed<seed>"
    method: str  # the arm's name
    seed: int
    start_time: str
    model_config: dict
    training_config: dict
    # final_train_loss, final_val_loss, final_val_ppl, training_time_hours; empty until the run ends
    results: dict
    notes: str
    status: str  # "running" | "finished" | "failed"
    exit_code: Optional[int]
    log_tail: str  # the last lines of the run's log when it failed
    config_hash: str  # sha256 of the resolved config
    git_revision: str


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


def file_sha256(path: Path) -> str:
    """sha256 of a file's content, read in chunks (hashlib releases the GIL while hashing)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
    resume_log = _Entry("resume_log.jsonl")
    experiment = _Entry("experiment.yaml")

    def checkpoint(self, tag: str) -> Path:
        return self.checkpoints / tag

    def train_state_file(self, tag: str) -> Path:
        return self.checkpoint(tag) / "train_state.json"

    def rng_state_file(self, tag: str, rank: int) -> Path:
        return self.checkpoint(tag) / f"rng_rank{rank}.pt"

    def topology_file(self, tag: str) -> Path:
        """The (world size, DP, TP, PP, ZeRO stage, precision) that wrote the tag (pretrain/reshard.py)."""
        return self.checkpoint(tag) / "topology.json"

    def topology_free_dir(self, tag: str) -> Path:
        """The tag converted once for resuming on another topology (pretrain/reshard.py's format)."""
        return self.checkpoint(tag) / "topology_free"

    def integrity_record_file(self, tag: str) -> Path:
        return self.checkpoint(tag) / "integrity.json"

    # ------------------------------------------------------------------ checkpoints
    @property
    def latest_pointer(self) -> Path:
        return self.checkpoints / "latest"

    def latest_checkpoint(self) -> Optional[str]:
        """Tag of the newest complete checkpoint (the `latest` pointer), or None."""
        pointer = self.latest_pointer
        return pointer.read_text().strip() if pointer.exists() else None

    def set_latest_checkpoint(self, tag: str) -> None:
        write_text_atomic(self.latest_pointer, tag)

    def checkpoint_tags(self) -> list[str]:
        """Every checkpoint directory, oldest first (complete or not)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(p.name for p in self.checkpoints.iterdir() if p.is_dir() and TAG_PATTERN.fullmatch(p.name))

    def read_train_state(self, tag: str) -> dict:
        return json.loads(self.train_state_file(tag).read_text())

    def write_train_state(self, tag: str, state: dict) -> None:
        write_text_atomic(self.train_state_file(tag), json.dumps(state, indent=2))

    def checkpoint_world_size(self, tag: str) -> int:
        """Processes that wrote the checkpoint: every rank saves its own RNG state."""
        return sum(1 for p in self.checkpoint(tag).iterdir() if RNG_STATE_PATTERN.fullmatch(p.name))

    # ------------------------------------------------------------------ checkpoint integrity
    def checkpoint_files(self, tag: str) -> list[str]:
        """Every file of a tag's directory as a relative path, sorted; its integrity record excluded."""
        root, record = self.checkpoint(tag), self.integrity_record_file(tag)
        own = {record.name, record.name + ".tmp"}
        names = (str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        return sorted(name for name in names if name not in own)

    def write_integrity_record(self, tag: str) -> dict:
        """Size and sha256 of every file of the tag, written atomically; call once all files are on disk."""
        root = self.checkpoint(tag)
        files = {name: {"size": (root / name).stat().st_size, "sha256": file_sha256(root / name)}
                 for name in self.checkpoint_files(tag)}
        record = {"algorithm": "sha256", "files": files}
        write_text_atomic(self.integrity_record_file(tag), json.dumps(record, indent=1) + "\n")
        return record

    def has_integrity_record(self, tag: str) -> bool:
        return self.integrity_record_file(tag).is_file()

    def verify_checkpoint(self, tag: str) -> list[str]:
        """What is wrong with a tag's files against its integrity record (each problem names its
        file); empty when every recorded file is there with its size and checksum. Sizes are
        checked first, so a missing or truncated file is reported without reading the rest."""
        root, record_file = self.checkpoint(tag), self.integrity_record_file(tag)
        if not root.is_dir():
            return [f"{root} does not exist"]
        if not record_file.is_file():
            return [f"{record_file} is missing"]
        try:
            files = json.loads(record_file.read_text())["files"]
            expected = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return [f"{record_file} is unreadable ({type(e).__name__}: {e})"]
        problems = []
        for name, (size, _) in expected.items():
            path = root / name
            if not path.is_file():
                problems.append(f"{path} is missing")
            elif path.stat().st_size != size:
                problems.append(f"{path} has {path.stat().st_size} bytes, {size} recorded")
        if problems:
            return problems
        return [f"{root / name} does not match its recorded sha256"
                for name, (_, digest) in expected.items() if file_sha256(root / name) != digest]

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

    def log_resume(self, entry: dict) -> None:
        """Append one line to resume_log.jsonl (which checkpoint, what was skipped, what changed)."""
        with open(self.resume_log, "a") as f:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **entry}, default=str) + "\n")

    def read_resume_log(self) -> list[dict]:
        if not self.resume_log.exists():
            return []
        return [json.loads(line) for line in self.resume_log.read_text().splitlines() if line]

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

    # ------------------------------------------------------------------ sweeps
    def write_experiment(self, record: ExperimentRecord) -> None:
        import yaml

        self.path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.experiment, yaml.safe_dump(asdict(record), sort_keys=False))

    def read_experiment(self) -> Optional[ExperimentRecord]:
        import yaml

        if not self.experiment.exists():
            return None
        return ExperimentRecord(**yaml.safe_load(self.experiment.read_text()))
