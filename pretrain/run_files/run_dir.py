"""A run directory as a typed API: the only module that knows its file names and formats.

    run_dir/
      run.lock                                       the job's exclusive lock; who took it (JSON)
      config.yaml  ds_config.json  versions.json     resolved config, DeepSpeed JSON, versions + git
      metrics.jsonl                                  one TrainRecord / EvalRecord per line (rank 0)
      summary.json                                   Summary of the finished (or stopped) run
      resume_log.jsonl                               one line per resume: checkpoint, skipped ones, config changes
      restarts.jsonl                                 one RestartRecord per failure of a supervised job
      hangs/<time>-step<N>-rank<r>.txt               every thread's stack, written by a rank's hang watchdog
      experiment.yaml                                ExperimentRecord of a sweep run (pretrain/research/sweep/)
      init_from.json                                 what the run's first start imported (init_from.path)
      init_from/weights.safetensors                  those weights, converted to the run's model (fp32)
      evaluations/<name>.json                        one post-training evaluation each (attention, probe, downstream)
      checkpoints/latest                             tag of the newest complete checkpoint
      checkpoints/step00001000/                      DeepSpeed files, train_state.json, rng_rank{r}.pt,
                                                     integrity.json (size + sha256 of every other file)
      tensorboard/  wandb/  data_cache/

The entry point, the trainer, the metrics logger, benchmarks, sweeps and tests read and write a
run through `RunDir`, so a layout change happens here only.

One job at a time writes a run dir: the job takes `RunDir.acquire_lock()`, an exclusive flock(2)
on run.lock, before it reads or changes anything and keeps it for its whole life; a second job is
refused with a message naming the first (pid, host, start time, command: written into run.lock).
flock belongs to the open file description, so every process holding a descriptor of it holds the
lock, and the kernel drops it with the last one, however the processes end (SIGKILL included): a
dead job never blocks the resume. A process hands its lock to the processes it starts (workers,
a sweep's run) as their stdin, since torchrun and DeepSpeed's launcher close every other
descriptor in their workers, and sets LOCK_ON_STDIN; `acquire_lock()` in such a process adopts it,
and a rank holds it with `handed_down_lock()`. Adopting takes it off stdin: the lock stays on a
close-on-exec descriptor that forked children close, and stdin becomes /dev/null, so the processes
a rank or a launcher starts besides its workers (wandb's service, git, compilers, DataLoader
workers) never hold it, and none outlives the job holding it.

A job killed a moment ago can still hold the lock for a while: a SIGKILLed rank's threads exit
after its main thread, tearing down its memory, and only the last of them drops the lock (up to
half a second measured on a loaded 2-core machine, well after the launcher has been reaped). So
where the lock is held and the process recorded in run.lock has ended on this host, a start waits
up to STRAGGLER_WAIT_S for the lock before refusing. A refusal names the recorded holder and every
process of this host that holds the lock (pid and command line, from /proc: those of other users
and hosts cannot be listed).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable, Optional, Union

from ora_megatron.config_io import parse_yaml, to_dict
from pretrain.run_files.lock import (
    LOCK_ON_STDIN,
    LockHolder,
    RunDirBusy,
    RunDirLock,
    flock_holders,
    process_ended,
    try_flock,
)
from pretrain.run_files.run_records import (
    EvalRecord,
    EventRecord,
    ExperimentRecord,
    Record,
    RestartRecord,
    Summary,
    TrainRecord,
)

TAG_PATTERN = re.compile(r"step(\d{8})")
RNG_STATE_PATTERN = re.compile(r"rng_rank(\d+)\.pt")
STRAGGLER_WAIT_S = 5.0  # a start's wait for the processes of a job whose recorded holder has ended


def config_hash(cfg) -> str:
    """sha256 of a resolved run config: names default run dirs, and tells a sweep a run's config changed."""
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()


def checkpoint_tag(step: int) -> str:
    return f"step{step:08d}"


def step_of_tag(tag: str) -> int:
    match = TAG_PATTERN.fullmatch(tag)
    if match is None:
        raise ValueError(f"not a checkpoint tag: {tag!r}")
    return int(match.group(1))


def _from_json(data: dict) -> Record:
    cls = {"train": TrainRecord, "event": EventRecord}.get(data["split"], EvalRecord)
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
    evaluations = _Entry("evaluations")
    lock_file = _Entry("run.lock")
    init_from_record = _Entry("init_from.json")
    init_from_dir = _Entry("init_from")

    @property
    def init_from_weights(self) -> Path:
        """The imported weights as the run's model holds them (pretrain/config/init_from.py)."""
        return self.init_from_dir / "weights.safetensors"

    def read_init_from(self) -> Optional[dict]:
        """The import record of a run that started from other weights (init_from.path), else None."""
        return json.loads(self.init_from_record.read_text()) if self.init_from_record.is_file() else None

    def write_init_from(self, record: dict) -> None:
        write_text_atomic(self.init_from_record, json.dumps(record, indent=1) + "\n")

    def forget_init_from(self) -> None:
        """A fresh start without init_from.path: an import left by an earlier start that never saved a
        checkpoint is not this run's."""
        self.init_from_record.unlink(missing_ok=True)
        shutil.rmtree(self.init_from_dir, ignore_errors=True)
    restarts = _Entry("restarts.jsonl")
    hangs = _Entry("hangs")

    def checkpoint(self, tag: str) -> Path:
        return self.checkpoints / tag

    def train_state_file(self, tag: str) -> Path:
        return self.checkpoint(tag) / "train_state.json"

    def rng_state_file(self, tag: str, rank: int) -> Path:
        return self.checkpoint(tag) / f"rng_rank{rank}.pt"

    def topology_file(self, tag: str) -> Path:
        """The (world size, DP, TP, PP, ZeRO stage, precision) that wrote the tag (pretrain/checkpoint/reshard.py)."""
        return self.checkpoint(tag) / "topology.json"

    def topology_free_dir(self, tag: str) -> Path:
        """The tag converted once for resuming on another topology (pretrain/checkpoint/reshard.py's format)."""
        return self.checkpoint(tag) / "topology_free"

    def integrity_record_file(self, tag: str) -> Path:
        return self.checkpoint(tag) / "integrity.json"

    def unwritable(self) -> Optional[str]:
        """Why this process cannot write the run dir, or None. The dir itself and every entry at its
        top level (each written or appended to by a run) must be writable, or, before it exists, the
        nearest folder it would be created in. os.access answers for this process's user: root passes
        permission bits, and nobody passes a read-only mount."""
        existing = self.path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing == self.path and not self.path.is_dir():
            return f"run dir {self.path} exists and is not a folder"
        written = [self.path, *self.path.iterdir()] if existing == self.path else [existing]
        for path in written:
            if not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
                return (f"run dir {self.path} cannot be written: {path} is read-only (its permissions, or a read-only "
                        "file system); the run writes its config, metrics and checkpoints there. Fix that, or use "
                        "another --run-dir")
        return None

    # ------------------------------------------------------------------ the job's lock
    def acquire_lock(self) -> RunDirLock:
        """The run dir's lock for this job: the one handed down to this process (LOCK_ON_STDIN, taken
        off stdin), else taken now and recorded as held by this process. Raises RunDirBusy naming the
        holders."""
        handed_down = self._adopt_handed_down_lock()
        if handed_down is not None:
            return handed_down
        self.path.mkdir(parents=True, exist_ok=True)
        lock = RunDirLock(os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644))
        if not self._free_after_stragglers(lambda: try_flock(lock.fd)):
            lock.release()
            raise RunDirBusy(self._busy_message())
        lock.record_holder(os.getpid(), shlex.join([sys.executable, *sys.argv]))
        return lock

    def check_lock(self) -> None:
        """Raise RunDirBusy where acquire_lock() would; keeps no lock and writes nothing."""
        handed_down = self._handed_down_lock()
        if handed_down is not None:
            handed_down.release()
        elif not self._free_after_stragglers(lambda: self.lock_holder() is None):
            raise RunDirBusy(self._busy_message())

    @contextlib.contextmanager
    def handed_down_lock(self):
        """Hold the lock handed down to this process (a rank: LOCK_ON_STDIN) for the block, off stdin,
        so that no process it starts holds it; nothing when none was handed down."""
        lock = self._adopt_handed_down_lock()
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    def lock_holder(self) -> Optional[str]:
        """Who holds the lock ("pid N on HOST since TIME: COMMAND"), None when nobody does.
        flock cannot be queried: this takes a shared lock for an instant (never creating the file)."""
        try:
            fd = os.open(self.lock_file, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return self._recorded_holder()
        finally:
            os.close(fd)
        return None

    def lock_holders(self) -> list[LockHolder]:
        """The processes of this host that hold the lock (flock_holders)."""
        return flock_holders(self.lock_file)

    def _holder_record(self) -> Optional[dict]:
        try:
            holder = json.loads(self.lock_file.read_text())
            return holder if {"pid", "host", "start_time", "command"} <= holder.keys() else None
        except (OSError, ValueError, AttributeError):  # its holder is writing it this instant
            return None

    def _recorded_holder(self) -> str:
        holder = self._holder_record()
        if holder is None:
            return f"a process that has not recorded itself in {self.lock_file} yet"
        return f"pid {holder['pid']} on {holder['host']} since {holder['start_time']}: {holder['command']}"

    def _recorded_holder_ended(self) -> bool:
        """Whether the process recorded in run.lock ran on this host and has ended."""
        holder = self._holder_record()
        return holder is not None and holder["host"] == platform.node() and process_ended(int(holder["pid"]))

    def _free_after_stragglers(self, free: Callable[[], bool]) -> bool:
        """free() now, or, where the recorded holder has ended on this host, within STRAGGLER_WAIT_S:
        what is left of a job killed a moment ago (its ranks' threads exiting) still holds the lock."""
        if free():
            return True
        if not self._recorded_holder_ended():
            return False
        deadline = time.monotonic() + STRAGGLER_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if free():
                return True
        return False

    def _busy_message(self) -> str:
        if self._recorded_holder_ended():
            head = (f"run dir {self.path} is in use: its lock was taken by {self._recorded_holder()}, which has "
                    f"ended, but {STRAGGLER_WAIT_S:g} s later other processes still hold it; it is free again "
                    "when they have ended")
        else:
            head = (f"run dir {self.path} is in use by {self._recorded_holder()}; one job at a time writes a run "
                    "dir, and it is free again when that job has ended")
        return "".join([head, *(f"\n  held by {holder}" for holder in self.lock_holders())])

    def _handed_down_lock(self) -> Optional[RunDirLock]:
        """This run dir's lock, when the process that started this one handed it down as stdin."""
        if os.environ.get(LOCK_ON_STDIN) != "1":
            return None
        try:
            if not os.path.samestat(os.fstat(0), os.stat(self.lock_file)):
                return None
            # The starter's open file description holds the lock: taking it again changes nothing.
            fcntl.flock(0, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # stdin closed, no lock file, or another job's lock (BlockingIOError)
            return None
        return RunDirLock(os.dup(0))

    def _adopt_handed_down_lock(self) -> Optional[RunDirLock]:
        """The handed-down lock, taken off stdin (/dev/null there, LOCK_ON_STDIN unset)."""
        lock = self._handed_down_lock()
        if lock is not None:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            del os.environ[LOCK_ON_STDIN]
        return lock

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
    def write_config(self, config: dict) -> None:
        """The config as the run trains it, resolved once before its workers start; they read it back."""
        import yaml

        self.path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.config, yaml.safe_dump(config, sort_keys=False))

    def write_run_files(self, ds_config: dict, versions: dict) -> None:
        """What ran the config: DeepSpeed's JSON, the versions and the git revision (rank 0, at every start)."""
        self.ds_config.write_text(json.dumps(ds_config, indent=2) + "\n")
        self.versions.write_text(json.dumps(versions, indent=2) + "\n")

    def log_resume(self, entry: dict) -> None:
        """Append one line to resume_log.jsonl (which checkpoint, what was skipped, what changed)."""
        with open(self.resume_log, "a") as f:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **entry}, default=str) + "\n")

    def read_resume_log(self) -> list[dict]:
        if not self.resume_log.exists():
            return []
        return [json.loads(line) for line in self.resume_log.read_text().splitlines() if line]

    # ------------------------------------------------------------------ faults
    def log_restart(self, record: RestartRecord) -> None:
        """Append one line to restarts.jsonl."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.restarts, "a") as f:
            f.write(json.dumps(asdict(record)) + "\n")

    def read_restarts(self) -> list[RestartRecord]:
        if not self.restarts.exists():
            return []
        return [RestartRecord(**json.loads(line)) for line in self.restarts.read_text().splitlines() if line]

    def hang_dump_file(self, rank: int, step: int) -> Path:
        stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        return self.hangs / f"{stamp}-step{step:08d}-rank{rank}.txt"

    def hang_dumps(self) -> list[Path]:
        """The stack dumps hang watchdogs wrote, oldest first."""
        return sorted(self.hangs.glob("*.txt")) if self.hangs.is_dir() else []

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

    # ------------------------------------------------------------------ evaluations
    def evaluation_file(self, name: str) -> Path:
        return self.evaluations / f"{name}.json"

    def write_evaluation(self, record: dict) -> Path:
        """evaluations/<record["name"]>.json, written atomically (NaN refused: null where no number)."""
        self.evaluations.mkdir(parents=True, exist_ok=True)
        path = self.evaluation_file(record["name"])
        write_text_atomic(path, json.dumps(record, indent=1, allow_nan=False) + "\n")
        return path

    # ------------------------------------------------------------------ sweeps
    def write_experiment(self, record: ExperimentRecord) -> None:
        import yaml

        self.path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.experiment, yaml.safe_dump(asdict(record), sort_keys=False))

    def read_experiment(self) -> Optional[ExperimentRecord]:
        if not self.experiment.exists():
            return None
        return ExperimentRecord(**parse_yaml(self.experiment.read_text()))
