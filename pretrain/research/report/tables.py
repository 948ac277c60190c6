"""A report table: rows of raw values, written as a Markdown table, a LaTeX table (latex.py), a CSV
file and JSON rows.

The CSV and JSON hold each value at full precision under its key (n/a: "n/a" in CSV, null in
JSON); a column renders one or more keys of a row into one cell (mean ± std), the same text in
Markdown and LaTeX.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

NA = "n/a"


@dataclass
class Column:
    header: str
    keys: tuple[str, ...]
    render: Callable[..., str]  # the row's values under `keys` → the cell
    mark: Optional[str] = None  # key of the row's Holm-adjusted p-value: LaTeX marks the cell when significant
    latex: bool = True  # shown in the LaTeX table (the paper's selection of columns)
    markdown: bool = True  # shown in the Markdown table (always in the CSV and JSON)


@dataclass
class Table:
    name: str  # the CSV file's stem and the JSON key
    columns: list[Column]
    rows: list[dict]

    @property
    def keys(self) -> list[str]:
        """Every key the columns show, in column order, once."""
        return list(dict.fromkeys(key for column in self.columns for key in column.keys))

    def records(self) -> list[dict]:
        """The rows as the CSV and JSON hold them: the shown keys only."""
        return [{key: row[key] for key in self.keys} for row in self.rows]

    def cells(self) -> list[list[str]]:
        """The Markdown table's cells."""
        columns = [column for column in self.columns if column.markdown]
        return [[column.render(*(row[key] for key in column.keys)) for column in columns] for row in self.rows]

    def markdown(self) -> str:
        columns = [column for column in self.columns if column.markdown]
        lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(escape_cell(cell) for cell in row) + " |" for row in self.cells()]
        return "\n".join(lines)

    def write_csv(self, folder: Path) -> Path:
        path = folder / f"{self.name}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.keys)
            writer.writeheader()
            for record in self.records():
                writer.writerow({key: NA if value is None else value for key, value in record.items()})
        return path


def escape_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------- cell renderers


def fixed(digits: int) -> Callable[[Optional[float]], str]:
    return lambda value: NA if value is None else f"{value:,.{digits}f}"


def significant(digits: int) -> Callable[[Optional[float]], str]:
    return lambda value: NA if value is None else f"{value:.{digits}g}"


def mean_std(number: Callable[[Optional[float]], str]) -> Callable[[Optional[float], Optional[float]], str]:
    """"mean ± std", each rendered by `number`; "± n/a" with one seed, "n/a" with none."""
    return lambda mean, std: NA if mean is None else f"{number(mean)} ± {number(std)}"


def interval(number: Callable[[Optional[float]], str]) -> Callable[[Optional[float], Optional[float]], str]:
    """"[low, high]", each rendered by `number`; "n/a" without an interval."""
    return lambda low, high: NA if low is None or high is None else f"[{number(low)}, {number(high)}]"


def plain(value) -> str:
    return NA if value is None else str(value)


def count(value: Optional[float]) -> str:
    """A count (parameters, steps), also a mean of identical counts."""
    return NA if value is None else f"{round(value):,}"
