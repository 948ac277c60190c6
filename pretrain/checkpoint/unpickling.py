"""The one way files of a run dir are unpickled: `safe_load`, DeepSpeed's own checkpoint loading included.

A run dir may come from someone else, and its integrity records do not vouch for it (whoever wrote
the files can rewrite them). A pickle can name any callable, which `torch.load(weights_only=False)`
calls, so every checkpoint, RNG-state, optimizer-state and conversion file is read with torch's
restricted unpickler (weights_only=True): tensors, containers, numbers, strings, and beside them
exactly the classes DeepSpeed 0.19.8 pickles into its optimizer files — the loss scaler of a ZeRO
optimizer (`loss_scaler`), its `zero_stage` and its partitions' `fragment_address`es
(`state_dict()` of runtime/zero/stage_1_and_2.py, stage3.py, bf16_optimizer.py). Each is rebuilt
by setting its `__dict__`, which runs no code of the class; the enum is looked up by value.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import zipfile
from pathlib import Path
from typing import Iterator

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from pretrain.runtime.ds_internals import engine_config

DEEPSPEED_CHECKPOINT_CLASSES = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file holds objects other than tensors and DeepSpeed's records: not loaded."""


@contextlib.contextmanager
def _only_safe_globals(allowed: list) -> Iterator[None]:
    """Exactly `allowed` beside torch's own types for the restricted unpickler, then the list as it was.

    torch keeps one process-wide list of extra allowed globals, and `import megatron.core` adds to it
    (numpy arrays, argparse.Namespace, io.BytesIO, pathlib paths, its own configs:
    megatron/core/safe_globals.py), which torch's `safe_globals` context manager would keep allowed."""
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(allowed)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def safe_load(path, map_location="cpu", mmap: bool = False):
    """torch.load with the restricted unpickler (weights_only=True), allowing DeepSpeed's checkpoint
    classes — nothing else — for this call; any other global raises UnsafeCheckpointFile naming the
    file. mmap: read the tensors only when used (files in torch's zip format, which DeepSpeed writes;
    others are read whole)."""
    try:
        with _only_safe_globals(DEEPSPEED_CHECKPOINT_CLASSES):
            return torch.load(path, map_location=map_location, weights_only=True,
                              mmap=mmap and zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        # torch's message names the refused global, or the class it was asked to build
        named = re.search(r"GLOBAL (\S+)|got <class '([^']+)'>", str(e))
        what = f"it names {named.group(1) or named.group(2)}" if named else "it does not unpickle as data"
        raise UnsafeCheckpointFile(f"{path}: not loaded: {what}; checkpoint files are read as tensors and "
                                   "DeepSpeed's checkpoint records only (unpickling anything else can run code)"
                                   ) from None


def check_checkpoint_files(checkpoint_dir) -> None:
    """Read DeepSpeed's files of a checkpoint directory (`*_states.pt`: model, layer and optimizer states)
    with the restricted unpickler, memory-mapped so that no tensor is read, before DeepSpeed's own readers,
    which unpickle without restriction, open them. Raises UnsafeCheckpointFile naming the first file that
    holds anything else. (The run's own files, RNG states and conversions, are only read by `safe_load`.)"""
    for path in sorted(Path(checkpoint_dir).glob("*_states.pt")):
        safe_load(path, mmap=True)


class RestrictedCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading through `safe_load` (its own load unpickles without
    restriction). The engine reads every file of `load_checkpoint` through it: model states, ZeRO
    partitions, pipeline layer files (`runtime/engine.py` `_load_checkpoint`, `_load_zero_checkpoint`;
    `runtime/pipe/module.py` `load_state_dir`)."""

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location=map_location)


def restrict_checkpoint_loading(engine) -> None:
    """Make `engine.load_checkpoint` read its files through RestrictedCheckpointEngine. DeepSpeed creates
    its checkpoint engine from its config (`_configure_checkpointing`, into `checkpoint_engine`) and
    takes none from the caller; the replacement saves as the torch engine did."""
    if type(engine.checkpoint_engine) not in (TorchCheckpointEngine, RestrictedCheckpointEngine):
        raise RuntimeError(f"DeepSpeed's checkpoint engine is {type(engine.checkpoint_engine).__name__}, not its "
                           "torch engine: re-check restrict_checkpoint_loading")
    engine.checkpoint_engine = RestrictedCheckpointEngine(engine_config(engine))
