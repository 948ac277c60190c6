"""`no_network()`: a block in which any socket connection or name lookup fails and is recorded."""

from __future__ import annotations

import sys
from contextlib import contextmanager

# An audit hook cannot be removed: it is installed once, at import, and acts only inside the block.
_state = {"watching": False, "attempts": []}


def _audit(event: str, args: tuple) -> None:
    if _state["watching"] and event in ("socket.connect", "socket.getaddrinfo"):
        _state["attempts"].append((event, args))
        raise RuntimeError(f"network access during a test: {event} {args}")


sys.addaudithook(_audit)


@contextmanager
def no_network():
    """Yields the list of network attempts made inside the block (each one also fails)."""
    _state.update(watching=True, attempts=[])
    try:
        yield _state["attempts"]
    finally:
        _state["watching"] = False
