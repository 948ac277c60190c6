"""megatron-core's Transformer Engine / Apex fallback warnings are silenced by importing ora_megatron, and only
those: torch's own path is the project's intended one."""

from __future__ import annotations

import importlib.util
import runpy
import warnings

from model_fixtures import build

import ora_megatron

# The modules of megatron-core 0.16 that warn, as they are imported, that TE / Apex are missing.
FALLBACK_WARNERS = ["megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision", "megatron.core.optimizer",
                    "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
                    "megatron.core.models.backends", "megatron.core.models.gpt.gpt_layer_specs"]


def import_warnings(silenced: bool) -> list[str]:
    """The warnings of running each FALLBACK_WARNERS module's code again (its first import happened before
    the test: runpy runs it in a namespace of its own), of building a model, and of one other megatron
    warning; with every warning shown but, if `silenced`, ora_megatron's filter."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if silenced:
            ora_megatron.silence_megatron_fallback_warnings()
        for name in FALLBACK_WARNERS:
            spec = importlib.util.find_spec(name)
            runpy.run_path(spec.origin, run_name=f"{name}.__init__" if spec.submodule_search_locations else name)
        build("ora_qr")
        warnings.warn_explicit("another megatron-core warning", UserWarning, "megatron/core/x.py", 1,
                               module="megatron.core.x")
    return [str(w.message) for w in caught]


def test_only_the_fallback_warnings_are_silenced(one_process_group):
    shown = import_warnings(silenced=False)
    fallbacks = [m for m in shown if "not installed. Falling back" in m]
    assert len(fallbacks) == len(FALLBACK_WARNERS)
    assert import_warnings(silenced=True) == [m for m in shown if m not in fallbacks]
    assert "another megatron-core warning" in import_warnings(silenced=True)
