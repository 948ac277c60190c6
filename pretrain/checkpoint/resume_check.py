"""Before any worker starts: may this run dir be resumed with this config, and from which checkpoint?

The entry point calls `check_resume` in the launching process, after the config and the data were
validated and before torchrun or any worker starts, so a resume that cannot work ends with a
message and exit status 2 instead of a traceback inside the workers. Both checks only read:

1. Integrity. From the `latest` pointer backwards, the first checkpoint whose files match its
   integrity record (size and sha256 of every file, written by the save) is the one to resume
   from; every damaged one on the way (a missing record included) is reported with the file at fault.
   DeepSpeed's files of the chosen checkpoint must then unpickle as data (tensors and DeepSpeed's
   records, read with the restricted unpickler): a record matches whatever its writer put there.
2. Config compatibility. The run's saved resolved config (config.yaml) and the new one are
   compared key by key (dotted keys, plus `world_size`: the checkpoint's process count); each
   differing key takes the policy of its longest matching prefix in `POLICIES`. One refused key
   refuses the resume; allowed changes are reported. `train.steps` below the checkpoint's step is
   refused too: the run has trained past it.

A resumed run trains the model settings its weight import took over at its first start
(`recorded_model`), and a run whose last checkpoint ends it has nothing to train (`nothing_to_train`).

`ResumePlan.apply` then does the only writes: `latest` moves to the chosen checkpoint when the one
it named is damaged (workers load `latest`, so they need no other channel to learn the tag), and
a line goes to the run dir's resume log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional

import yaml

from ora_megatron.config_io import ConfigError, to_dict
from ora_megatron.model_config import ModelConfig
from pretrain.config.run_config import RunConfig, read_run_config
from pretrain.run_files.run_dir import RunDir, step_of_tag


class ResumeRefused(Exception):
    """The run dir cannot be resumed with this config (or has no intact checkpoint)."""


@dataclass(frozen=True)
class Policy:
    allowed: bool
    reason: str


WORLD_SIZE_KEY = "world_size"  # not a config key: the process count (a checkpoint's: its rng_rank{r}.pt files)

# Changes that reshape how parameters and optimizer state are partitioned over processes. Allowed: the
# resume converts the checkpoint to the new partition (TOPOLOGY's reason says how).
TOPOLOGY_KEYS = frozenset({"parallel.tensor", "parallel.pipeline", "deepspeed.zero_stage", WORLD_SIZE_KEY})
TOPOLOGY = Policy(True, "the checkpoint is converted once to a topology-free form (pretrain/checkpoint/reshard.py)")

SAFE = Policy(True, "read afresh on every start")
UNCLASSIFIED = Policy(False, "not classified in pretrain.checkpoint.resume_check.POLICIES, so treated as "
                             "incompatible")

# Dotted key prefix -> policy; the longest matching prefix wins (`train` covers `train.steps`).
POLICIES: dict[str, Policy] = {
    "model": Policy(False, "the checkpoint holds this model's weights (sizes, family, attention variant, "
                           "vocabulary, positions; frozen Q/K are regenerated from the seed)"),
    "data": Policy(True, "from the resumed step on, batches come from the new data settings"),
    "data.tokenizer": Policy(False, "token ids index the checkpoint's embedding rows; another tokenizer "
                                    "gives them other meanings"),
    "train": SAFE,
    "train.micro_batch_size": Policy(True, "a step still averages the same global batch, split differently"),
    "train.steps": Policy(True, "the LR schedule keeps the checkpoint's decay horizon"),
    "train.global_batch_size": Policy(False, "step s reads samples [s·G, (s+1)·G), so another G would skip or "
                                             "repeat data (and change what a step means for the LR schedule)"),
    "eval": SAFE,
    "speed": SAFE,
    "freeze.schedule": Policy(False, "the checkpoint's freeze stage indexes the schedule, and its "
                                     "optimizer state holds that stage's trainable parameters"),
    "optimizer": Policy(False, "the LR schedule and AdamW hyperparameters are restored from the checkpoint, "
                               "so the new value would be silently ignored"),
    "optimizer.clip_grad": Policy(True, "DeepSpeed's gradient clipping is read from the config on every start"),
    "deepspeed.precision": Policy(False, "DeepSpeed lays the optimizer state out per precision (bf16: fp32 master "
                                         "weights beside bf16 ones, BF16_Optimizer under ZeRO-0, bf16_zero_* files; "
                                         "fp16: a loss scaler too) and does not convert it on load"),
    "deepspeed.zero_with_one_rank": Policy(True, "it only picks the ZeRO stage, and a stage change is converted "
                                                 "like any topology change"),
    "logging": SAFE,
    "checkpoint": SAFE,
    "stability": SAFE,
    "supervision": SAFE,
    "faults": SAFE,
    "init_from": Policy(True, "read at a run's first start only: a resume continues from its checkpoint and imports "
                              "nothing (imported Q/K, if chosen, are the run's: init_from.json)"),
    **{key: TOPOLOGY for key in TOPOLOGY_KEYS},
}


def policy_of(key: str) -> Policy:
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        policy = POLICIES.get(".".join(parts[:n]))
        if policy is not None:
            return policy
    return UNCLASSIFIED


def flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Dotted leaf keys of a nested mapping; lists are leaves (`freeze.schedule`)."""
    for key, value in tree.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value:
            yield from flatten(value, dotted)
        else:
            yield dotted, value


_ABSENT = "<absent>"


def differences(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Every dotted key whose value differs, in the new config's order: key -> (old, new)."""
    before, after = dict(flatten(old)), dict(flatten(new))
    keys = list(after) + [k for k in before if k not in after]
    return {k: (before.get(k, _ABSENT), after.get(k, _ABSENT)) for k in keys
            if before.get(k, _ABSENT) != after.get(k, _ABSENT)}


def _show(value: Any) -> str:
    return value if value is _ABSENT else json.dumps(value, default=str)


def describe(key: str, old: Any, new: Any) -> str:
    return f"{key} {_show(old)} → {_show(new)}"


@dataclass
class ResumePlan:
    """What `check_resume` decided; `tag` is None when there is nothing to resume (a fresh run)."""

    tag: Optional[str] = None
    latest: Optional[str] = None  # the pointer as found
    skipped: dict[str, list[str]] = field(default_factory=dict)  # damaged tag -> what is wrong
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # allowed config changes

    def notices(self) -> list[str]:
        """Warnings (damaged checkpoints) and the one line of config changes."""
        lines = [f"warning: checkpoint {tag} is damaged ({'; '.join(problems)}); skipped"
                 for tag, problems in self.skipped.items()]
        if self.skipped:
            lines.append(f"warning: resuming from {self.tag}, the newest intact checkpoint")
        if self.changes:
            lines.append(f"resuming from {self.tag} with changed settings: "
                         + ", ".join(describe(k, *v) for k, v in self.changes.items()))
        return lines

    def apply(self, run_dir: RunDir) -> None:
        """Point `latest` at the chosen checkpoint and log the resume; nothing to do for a fresh run."""
        if self.tag is None:
            return
        if self.tag != self.latest:
            run_dir.set_latest_checkpoint(self.tag)
        run_dir.log_resume({"checkpoint": self.tag, "step": step_of_tag(self.tag), "latest_was": self.latest,
                            "skipped": self.skipped,
                            "changes": {k: list(v) for k, v in self.changes.items()}})


def check_resume(run_dir: RunDir, cfg: RunConfig, world_size: int) -> ResumePlan:
    """Pick the checkpoint to resume from and check it and the config against it; reads only.
    Raises ResumeRefused when no checkpoint is intact, one of its files could run code when loaded,
    or a change is refused."""
    latest = run_dir.latest_checkpoint()
    if latest is None:
        return ResumePlan()
    tag, skipped = choose_checkpoint(run_dir, latest)
    check_files_are_data(run_dir, tag)
    if cfg.train.steps < step_of_tag(tag):
        raise ResumeRefused(f"cannot resume {run_dir.path} from checkpoint {tag} with train.steps={cfg.train.steps}: "
                            f"the run has trained {step_of_tag(tag)} steps. Resume with train.steps >= "
                            f"{step_of_tag(tag)}, or start a shorter run with another --run-dir.")
    changes = check_config(run_dir, tag, cfg, world_size)
    return ResumePlan(tag=tag, latest=latest, skipped=skipped, changes=changes)


def check_files_are_data(run_dir: RunDir, tag: str) -> None:
    """DeepSpeed's files of the checkpoint unpickle with the restricted unpickler (pretrain/checkpoint/unpickling.py;
    the workers read the run's own files with it too). Its integrity record cannot vouch for that: whoever
    wrote a received run dir wrote the record too."""
    from pretrain.checkpoint.unpickling import UnsafeCheckpointFile, check_checkpoint_files  # imports DeepSpeed

    try:
        check_checkpoint_files(run_dir.checkpoint(tag))
    except UnsafeCheckpointFile as e:
        raise ResumeRefused(f"cannot resume {run_dir.path} from checkpoint {tag}: {e}") from None


def choose_checkpoint(run_dir: RunDir, latest: str) -> tuple[str, dict[str, list[str]]]:
    """(tag, damaged tags -> problems): the newest intact checkpoint at or before `latest`."""
    try:
        newest = step_of_tag(latest)
    except ValueError:
        raise ResumeRefused(f"{run_dir.latest_pointer} holds {latest!r}, not a checkpoint tag") from None
    candidates = [t for t in reversed(run_dir.checkpoint_tags()) if step_of_tag(t) <= newest]
    if latest not in candidates:  # its directory is gone: reported as damaged below
        candidates.insert(0, latest)
    skipped: dict[str, list[str]] = {}
    for tag in candidates:
        problems = run_dir.verify_checkpoint(tag)
        if not problems:
            return tag, skipped
        skipped[tag] = problems
    lines = "\n".join(f"  {tag}: {'; '.join(problems)}" for tag, problems in skipped.items())
    raise ResumeRefused(f"no intact checkpoint to resume {run_dir.path} from:\n{lines}\n"
                        f"Restore the files, or move {run_dir.checkpoints} away to start from scratch.")


def check_config(run_dir: RunDir, tag: str, cfg: RunConfig, world_size: int) -> dict[str, tuple[Any, Any]]:
    """The allowed changes between the run's saved config and `cfg`; raises on any refused one."""
    try:
        saved = read_run_config(run_dir)
    except (ConfigError, OSError, yaml.YAMLError) as e:
        raise ResumeRefused(f"cannot compare with the run's saved config {run_dir.config}: {e}") from None
    changes = differences({**to_dict(saved), WORLD_SIZE_KEY: run_dir.checkpoint_world_size(tag)},
                          {**to_dict(cfg), WORLD_SIZE_KEY: world_size})
    refused = {k: v for k, v in changes.items() if not policy_of(k).allowed}
    if refused:
        lines = "\n".join(f"  {describe(k, *v)}: {policy_of(k).reason}" for k, v in refused.items())
        raise ResumeRefused(f"cannot resume {run_dir.path} from checkpoint {tag} with this config; refused changes:\n"
                            f"{lines}\nResume with the saved values, or start a new run with another --run-dir.")
    return changes


def recorded_model(model: ModelConfig, run_dir: RunDir) -> ModelConfig:
    """The model as the run trains it: with the settings its import took over (from its record), if any."""
    record = run_dir.read_init_from()
    for key, (_, new) in (record or {}).get("taken_over", {}).items():
        model = replace(model, **{key.removeprefix("model."): new})
    return model


def nothing_to_train(run_dir: RunDir, tag: Optional[str], cfg: RunConfig) -> Optional[str]:
    """The message for a run that resuming from checkpoint `tag` would not train (it has a summary
    and `tag` is its last step: the command of a finished run, again), else None. Such a run's
    files stay as they are: no run files, resume log line or summary is written. A run that early
    stopping ended is finished too, unless its early-stopping settings changed since."""
    if tag is None or not run_dir.summary.exists():
        return None
    step = step_of_tag(tag)
    if step >= cfg.train.steps:
        return f"run dir {run_dir.path}: finished at step {step}, nothing to train"
    summary = run_dir.read_summary()
    if (summary.stopped_early and summary.steps == step
            and read_run_config(run_dir).eval.early_stopping == cfg.eval.early_stopping):
        return (f"run dir {run_dir.path}: stopped early at step {step} (eval.early_stopping), nothing to train; "
                "change eval.early_stopping to train on")
    return None
