"""pyproject.toml's extras: `pip install .` trains, converts, exports and builds data without them; the
research tools need `research` (scipy, matplotlib) and downstream evaluation `eval` (lm-eval)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def needs_extra(extra: str) -> Iterator[None]:
    """Around the imports of what the extra `extra` installs, and nothing else: one of them missing ends the
    program with what to install instead of an ImportError."""
    try:
        yield
    except ModuleNotFoundError as error:
        raise SystemExit(f"error: cannot import {error.name}, which comes with ora's {extra} extra: "
                         f"pip install 'ora[{extra}]' (from a checkout: pip install -e '.[{extra}]')") from None
