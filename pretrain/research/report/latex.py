"""A report Table as a LaTeX table for papers: booktabs rules (no vertical ones), the cells the
Markdown shows, numbers in math mode (mean ± std as `$1.234 \\pm 0.012$`, an interval as
`$[0.010, 0.020]$`, 1.9e-06 as `$1.9 \\times 10^{-6}$`), text with LaTeX's special characters escaped.

A column with a `mark` key gets `^{*}` where the row's Holm-adjusted p-value under that key is
below 0.05 and `^{**}` below 0.01; the caption ends with that legend. The file needs
\\usepackage{booktabs} in the document's preamble.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from pretrain.research.report.tables import NA, Column, Table

MARK_KEY = "t_test_p_holm"  # the p-value whose significance the report's tables mark
MARKS = ((0.01, "**"), (0.05, "*"))  # (Holm-adjusted p below, mark), strictest first
MARKS_LEGEND = r"$^{*}$: Holm-adjusted $p < 0.05$; $^{**}$: Holm-adjusted $p < 0.01$."
# One number as the cell renderers write it (tables.py: fixed, significant, count).
NUMBER = re.compile(r"(?P<mantissa>-?(\d[\d,]*(\.\d*)?|\.\d+))(e(?P<exponent>[-+]?\d+))?")
MEAN_STD = " ± "
INTERVAL = re.compile(r"\[(?P<low>\S+), (?P<high>\S+)\]")  # tables.interval's "[low, high]"

SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
           "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
           # What the report's headers and notes hold beyond ASCII (pdflatex's inputenc lacks some).
           "−": "$-$", "±": r"$\pm$", "–": "--", "—": "---", "×": r"$\times$", "≤": r"$\le$", "≥": r"$\ge$"}


def escape(text: str) -> str:
    """Text as LaTeX typesets it literally (arm names, headers, notes)."""
    return "".join(SPECIAL.get(character, character) for character in text)


def significance_mark(p: Optional[float]) -> str:
    """"**" below 0.01, "*" below 0.05, "" otherwise or without a p-value."""
    return next((mark for threshold, mark in MARKS if p is not None and p < threshold), "")


def _math_number(text: str) -> Optional[str]:
    """A number cell part in math mode (thousands separators kept), None when it is not a number."""
    if text == NA:
        return r"\mathrm{n/a}"
    number = NUMBER.fullmatch(text)
    if number is None:
        return None
    mantissa = number["mantissa"].replace(",", "{,}")
    return mantissa if number["exponent"] is None else rf"{mantissa} \times 10^{{{int(number['exponent'])}}}"


def cell(column: Column, row: dict) -> str:
    """The column's cell of the row: its rendered text in math mode when it is a number, a
    mean ± std or an interval, escaped text otherwise; marked when the row's p-value under column.mark is significant
    (an n/a cell never is)."""
    text = column.render(*(row[key] for key in column.keys))
    mark = significance_mark(row.get(column.mark)) if column.mark and text != NA else ""
    interval = INTERVAL.fullmatch(text)
    if interval:
        low, high = _math_number(interval["low"]), _math_number(interval["high"])
        if low is not None and high is not None:
            return f"$[{low}, {high}]" + (f"^{{{mark}}}" if mark else "") + "$"
    parts = [_math_number(part) for part in text.split(MEAN_STD)]
    if text != NA and all(part is not None for part in parts):
        return "$" + r" \pm ".join(parts) + (f"^{{{mark}}}" if mark else "") + "$"
    return escape(text) + (rf"\textsuperscript{{{mark}}}" if mark else "")


def latex_table(table: Table, caption: str) -> str:
    """A table float holding the table's LaTeX columns. `caption` is LaTeX (escape() its names);
    the marks' legend follows it when a column is marked."""
    columns = [column for column in table.columns if column.latex]
    rows = [[cell(column, row) for column in columns] for row in table.rows]
    # Numbers align right: a column whose cells are all math (or n/a).
    numeric = [bool(rows) and all(row[i].startswith("$") or row[i] == NA for row in rows) for i in range(len(columns))]
    if any(column.mark for column in columns):
        caption = f"{caption} {MARKS_LEGEND}"
    lines = [r"% " + f"pretrain.research.report: table {table.name}; needs \\usepackage{{booktabs}}",
             r"\begin{table}[htbp]", r"\centering", rf"\caption{{{caption}}}", rf"\label{{tab:{table.name}}}",
             r"\begin{tabular}{" + "".join("r" if right else "l" for right in numeric) + "}", r"\toprule",
             " & ".join(escape(column.header) for column in columns) + r" \\", r"\midrule"]
    lines += [" & ".join(row) + r" \\" for row in rows]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def write_latex(table: Table, folder: Path, caption: str) -> Path:
    """folder/<table name>.tex (see latex_table)."""
    path = folder / f"{table.name}.tex"
    path.write_text(latex_table(table, caption))
    return path
