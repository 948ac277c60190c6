"""The spec language of a sweep and its expansion: one run per (seed, arm), each with its validated
config, its run dir and the `--set` arguments of its command (the package docstring describes a spec)."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from ora_megatron.config_io import ConfigError, check, flow_yaml, from_dict, load_yaml
from pretrain.config.run_config import RunConfig, load_run_config, validate_for_world
from pretrain.paths import ENTRY_MODULE, preset_path
from pretrain.run_files.run_dir import RunDir

DESIGN_SEEDS = [42, 2024, 12345, 98765, 555666]  # the research plan's seeds (docs/research.md)
SEED_KEYS = ("model.seed", "data.seed")
SEED_FIELD = "{seed}"  # in a spec's string value: the run's seed
ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
LOG_NAME = "sweep.log"
# The post-training evaluations a spec may list: each is the command (after the interpreter) that
# writes RUN/evaluations/<name>.json of the run dir given with --run-dir. The downstream tasks read
# a Hugging Face export, which a sweep does not make: they are run by hand.
EVALUATIONS = {"attention": ["-m", "pretrain.research.analyze"], "probe": ["-m", "pretrain.research.probes"]}
# The quantities a spec's `gaps` may put on x, each read from every run (pretrain.research.report.gaps).
GAP_QUANTITIES = {
    "head_dim": "d_k per head: model.kv_channels, or hidden_size / num_attention_heads (the run's config)",
    "parameters": "the model's parameters: trainable + frozen (the run's summary.json)",
    "seq_length": "model.seq_length (the run's config)",
    "num_layers": "model.num_layers (the run's config)",
}


class SweepError(Exception):
    """A spec, an expanded config or the command line is invalid; nothing was started."""


# ---------------------------------------------------------------------- the spec


@dataclass
class ScaleSpec:
    processes_per_node: int = 1
    """Processes of one run, all on one node (its GPUs on a cluster); multi-node runs are not swept yet."""
    set: dict[str, Any] = field(default_factory=dict)
    """Config overrides (dotted key: value) of every run at this scale."""

    def validate(self, key: str) -> None:
        check(self.processes_per_node >= 1, f"{key}.processes_per_node", "must be >= 1")


@dataclass
class ArmSpec:
    description: str = ""
    """What the arm is (the record's notes)."""
    set: dict[str, Any] = field(default_factory=dict)
    """Config overrides of this arm at every scale."""
    scales: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Config overrides of this arm at one scale (e.g. its width at cpu and at paper scale)."""


@dataclass
class GapPair:
    shape: str
    arm: str  # <shape>_<gaps.arm>
    reference: str  # <shape>_<gaps.reference>


def metric_key(metric: str) -> tuple[str, str]:
    """`<evaluation>.<metric>` (a gaps.metrics entry) as (evaluation, metric)."""
    evaluation, _, name = metric.partition(".")
    return evaluation, name


@dataclass
class GapsSpec:
    """The question "how does arm − reference move with shape": arms named `<shape>_<arm>` and
    `<shape>_<reference>` are one shape's pair, and `x` is the quantity the shapes vary."""

    arm: str = ""
    """Suffix of the arms whose loss is the minuend (e.g. ora: heads2_ora, heads4_ora, ...)."""
    reference: str = ""
    """Suffix of their twins (e.g. vanilla: heads2_vanilla, ...)."""
    x: str = ""
    """What the shapes vary, read from each run: one of GAP_QUANTITIES."""
    metrics: list[str] = field(default_factory=list)
    """Evaluation summary metrics, `<evaluation>.<metric>` (e.g. probe.answer_accuracy), whose paired gap
    per shape the report gives beside the loss's."""

    def validate(self, key: str) -> None:
        for name in ("arm", "reference"):
            check(bool(ARM_NAME.fullmatch(getattr(self, name))), f"{key}.{name}",
                  "name the suffix after `<shape>_` of the arms (letters, digits, '_', '.', '-')")
        check(self.arm != self.reference, f"{key}.reference", f"must differ from arm ({self.arm!r})")
        check(self.x in GAP_QUANTITIES, f"{key}.x", f"{self.x!r} is not one of: {', '.join(GAP_QUANTITIES)}")
        for metric in self.metrics:
            evaluation, name = metric_key(metric)
            check(evaluation in EVALUATIONS and bool(name), f"{key}.metrics",
                  f"{metric!r} is not <evaluation>.<metric> with an evaluation of {', '.join(EVALUATIONS)}")
        check(len(set(self.metrics)) == len(self.metrics), f"{key}.metrics", "each metric at most once")

    def pairs(self, arms) -> list[GapPair]:
        """Every shape with both arms, in the order of `arms`: `<shape>_<arm>` and `<shape>_<reference>`."""
        suffix = f"_{self.arm}"
        shapes = [name[:-len(suffix)] for name in arms if name.endswith(suffix) and len(name) > len(suffix)]
        return [GapPair(shape, f"{shape}{suffix}", f"{shape}_{self.reference}") for shape in shapes
                if f"{shape}_{self.reference}" in arms]


@dataclass
class SweepSpec:
    config: str = ""
    """Run config: a preset name (pretrain/configs/NAME.yaml) or a path relative to the spec file."""
    description: str = ""
    reference: str = ""
    """The arm the others are compared with."""
    seeds: list[int] = field(default_factory=lambda: list(DESIGN_SEEDS))
    scales: dict[str, ScaleSpec] = field(default_factory=dict)
    arms: dict[str, ArmSpec] = field(default_factory=dict)
    evaluations: list[str] = field(default_factory=list)
    """Post-training evaluations of every run, in order, after it trains (attention, probe)."""
    gaps: Optional[GapsSpec] = None
    """The report's gap of each shape's arm against its twin, against x (optional)."""

    def validate(self, key: str) -> None:
        check(bool(self.config), "config", "name the run config (a preset name or a path)")
        check(bool(self.arms), "arms", "a spec needs at least one arm")
        check(self.reference in self.arms, "reference", f"{self.reference!r} is not one of the arms {list(self.arms)}")
        check(bool(self.seeds) and len(set(self.seeds)) == len(self.seeds), "seeds", "must be distinct, at least one")
        for name, arm in self.arms.items():
            check(bool(ARM_NAME.fullmatch(name)), f"arms.{name}", "arm names become directory names: "
                  "letters, digits, '_', '.', '-'")
            unknown = sorted(set(arm.scales) - set(self.scales))
            check(not unknown, f"arms.{name}.scales", f"unknown scales {unknown} (the spec has {list(self.scales)})")
        for name in self.evaluations:
            check(name in EVALUATIONS, "evaluations", f"unknown evaluation {name!r} (a sweep runs "
                  f"{', '.join(EVALUATIONS)}; downstream reads a Hugging Face export and runs by hand)")
        check(len(set(self.evaluations)) == len(self.evaluations), "evaluations", "each evaluation at most once")
        if self.gaps is not None:
            check(bool(self.gaps.pairs(self.arms)), "gaps", f"no shape has both arms <shape>_{self.gaps.arm} and "
                  f"<shape>_{self.gaps.reference} (the arms: {', '.join(self.arms)})")
            unrun = [metric for metric in self.gaps.metrics if metric_key(metric)[0] not in self.evaluations]
            check(not unrun, "gaps.metrics", f"{', '.join(unrun)}: the sweep runs no such evaluation "
                  f"(evaluations: {self.evaluations})")


@dataclass
class Spec:
    name: str  # the spec file's stem: the first part of every experiment_id
    path: Path
    config_path: Path
    body: SweepSpec


def load_spec(path: Path) -> Spec:
    try:
        body = from_dict(SweepSpec, load_yaml(path))
    except (ConfigError, OSError, yaml.YAMLError) as e:
        raise SweepError(f"{path}: {e}") from None
    config_path = preset_path(body.config) or (path.parent / body.config).resolve()
    if not config_path.is_file():
        raise SweepError(f"{path}: config {body.config!r}: no file {config_path}")
    return Spec(name=path.stem, path=path, config_path=config_path, body=body)


# ---------------------------------------------------------------------- expansion


def set_arguments(overrides: dict[str, Any]) -> list[str]:
    return [f"{key}={flow_yaml(value)}" for key, value in overrides.items()]


@dataclass
class Run:
    spec: Spec
    arm: str
    seed: int
    scale: ScaleSpec
    run_dir: RunDir
    overrides: list[str]  # the `--set` arguments, in order
    cfg: RunConfig

    @property
    def experiment_id(self) -> str:
        return f"{self.spec.name}/{self.arm}/seed{self.seed}"

    @property
    def log(self) -> Path:
        return self.run_dir.path / LOG_NAME

    def set_flags(self) -> list[str]:
        return [arg for item in self.overrides for arg in ("--set", item)]

    def local_command(self) -> list[str]:
        """The entry point as a user runs it (torchrun spawned by it for more than one process)."""
        return [sys.executable, "-m", ENTRY_MODULE, "--config", str(self.spec.config_path), "--run-dir",
                str(self.run_dir.path), "--nproc-per-node", str(self.scale.processes_per_node), *self.set_flags()]

    def evaluation_command(self, name: str) -> list[str]:
        """The evaluation that writes this run's evaluations/<name>.json (of its latest checkpoint)."""
        return [sys.executable, *EVALUATIONS[name], "--run-dir", str(self.run_dir.path)]


def for_seed(overrides: dict[str, Any], seed: int) -> dict[str, Any]:
    """The spec's overrides for one seed: `{seed}` in a string value is the run's seed (e.g. the run of
    another sweep that a transfer arm starts from: init_from.path: runs/sweeps/core/ora/seed{seed})."""
    return {key: value.replace(SEED_FIELD, str(seed)) if isinstance(value, str) else value
            for key, value in overrides.items()}


def expand(spec: Spec, scale_name: str, seeds: Optional[list[int]], extra: list[str], out: Path) -> list[Run]:
    """Every (seed, arm) run with its validated config, seed-major; raises SweepError on the first bad one."""
    body = spec.body
    if scale_name not in body.scales:
        raise SweepError(f"{spec.path}: no scale {scale_name!r} (the spec has {list(body.scales)})")
    seeded = [item for item in extra if item.partition("=")[0] in SEED_KEYS]
    if seeded:
        raise SweepError(f"--set {seeded[0]}: {' and '.join(SEED_KEYS)} are set per run from the seeds (--seeds)")
    scale = body.scales[scale_name]
    runs = []
    for seed in seeds or body.seeds:
        for arm_name, arm in body.arms.items():
            overrides = (set_arguments(for_seed(scale.set, seed)) + set_arguments(for_seed(arm.set, seed))
                         + set_arguments(for_seed(arm.scales.get(scale_name, {}), seed)) + list(extra)
                         + [f"{key}={seed}" for key in SEED_KEYS])
            try:
                cfg = load_run_config(str(spec.config_path), overrides)
                validate_for_world(cfg, scale.processes_per_node)
            except ConfigError as e:
                raise SweepError(f"{spec.path}: arm '{arm_name}' (scale {scale_name}, seed {seed}, "
                                 f"{scale.processes_per_node} processes): {e}") from None
            runs.append(Run(spec, arm_name, seed, scale, RunDir(out / arm_name / f"seed{seed}"), overrides, cfg))
    return runs
