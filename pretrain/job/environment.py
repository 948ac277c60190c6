"""The process environment a run sets before the libraries that read it start: off the network,
and the CUDA runtime's settings for the run's layout."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path

from ora_megatron.model_config import ParallelConfig
from pretrain.paths import REPO

# Keep the Hugging Face libraries (huggingface_hub, transformers, datasets) off the network:
# training reads local tokenizers and datasets only, and an export is loaded from its own folder.
HUB_OFFLINE_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                           "HF_HUB_DISABLE_TELEMETRY": "1"}


def keep_offline() -> None:
    """Keep this process, and the workers it starts (they inherit its environment), off the Hugging Face
    hub: call it before any Hugging Face library is imported, as they read these variables at import."""
    os.environ.update(HUB_OFFLINE_ENVIRONMENT)


def keep_wandb_offline(wandb_mode: str) -> None:
    """wandb may use the network when `wandb_mode` is "online" only. Call it before wandb is imported (its
    workers inherit it): wandb's telemetry takes its mode from the environment alone
    (`wandb.init(mode="offline")` still lets it contact its server)."""
    if wandb_mode != "online":
        os.environ["WANDB_MODE"] = wandb_mode


def device_environment(parallel: ParallelConfig) -> dict[str, str]:
    """Variables the CUDA runtime must see before it starts, for this config's layout.

    With tensor parallelism, megatron-core overlaps its TP all-reduce with the next GEMM only when
    the device executes kernels in issue order: one hardware work queue (CUDA_DEVICE_MAX_CONNECTIONS=1).
    """
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if parallel.tensor > 1 else {}


def megatron_core_version() -> str:
    """The installed megatron-core's version, as its wheel states it. megatron.core.package_info's
    `__version__` appends the short git hash of whatever repository holds its install folder: from a
    virtualenv inside this checkout that is this project's HEAD, not megatron-core's."""
    return importlib.metadata.version("megatron-core")


def git_revision(root: Path = REPO) -> str:
    """HEAD of the checkout whose root is `root` (the project's), with "-dirty" when its work tree has changes.
    Without git, or where `root` is not a checkout's root (the Docker image and the GPU machine's copy have no
    .git; a copy inside another repository would otherwise get that repository's HEAD): ORA_GIT_REVISION,
    which their builders set (docker/Dockerfile, docker/gpu_bringup.sh), else empty."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        revision = git("rev-parse", "HEAD") if top and Path(top).resolve() == root.resolve() else ""
        dirty = bool(revision) and bool(git("status", "--porcelain"))
    except OSError:
        revision, dirty = "", False
    return revision + "-dirty" if dirty else revision or os.environ.get("ORA_GIT_REVISION", "")
