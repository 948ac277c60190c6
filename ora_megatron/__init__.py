"""The ORA model built from megatron-core parts (see builder.py, stages.py)."""

import warnings

# What megatron-core warns, once per module as it is first imported, when Transformer Engine or Apex is
# missing: that it falls back to torch's own norms, optimizers and multi-tensor ops.
MEGATRON_FALLBACK_WARNING = r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed\. Falling back"


def silence_megatron_fallback_warnings() -> None:
    """Hide megatron-core's Transformer Engine / Apex fallback warnings, and only those.

    torch's own path (megatron's local layer spec, SDPA) is this project's intended one, and the only one
    on its GPU machine (Transformer Engine cannot travel there): the warnings alarm users for nothing. They
    are raised at import time by whichever module imports megatron-core first, so they are silenced here,
    before any module of the package imports it."""
    warnings.filterwarnings("ignore", message=MEGATRON_FALLBACK_WARNING, category=UserWarning, module="megatron")


silence_megatron_fallback_warnings()
