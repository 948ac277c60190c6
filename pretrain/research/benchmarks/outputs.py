"""What a benchmark leaves behind: the command that reruns it, recorded beside its figures; its
records as JSON and its table as Markdown where asked; the table on stdout."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional


def rerun_command(module: str, argv: Optional[list[str]]) -> list[str]:
    """`python -m MODULE ARGS` as this invocation was given (argv None: the process's own arguments)."""
    return ["python", "-m", module, *(argv if argv is not None else sys.argv[1:])]


def publish(table: str, json_text: str, json_path: Optional[Path], markdown_path: Optional[Path]) -> None:
    """Write the JSON and the table where asked, and print the table."""
    if json_path:
        Path(json_path).write_text(json_text)
    if markdown_path:
        Path(markdown_path).write_text(table + "\n")
    print(table)
