"""The one markdown table renderer of kvp_cache: model cards, evaluation and sweep reports.

    >>> print(markdown_table(["method", "64", "256"], [["kvp", 0.125, 0.03125], ["knorm", 0.5, 0.25]]))
    | method | 64 | 256 |
    |---|---:|---:|
    | kvp | 0.125 | 0.03125 |
    | knorm | 0.5 | 0.25 |

The first column holds names (left-aligned), the others numbers (right-aligned). Strings are
shown as they are, so a caller who wants a fixed format per column formats those cells itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

MISSING = "-"


def format_cell(value: object, float_format: str = ".4g") -> str:
    """One cell's text: floats with ``float_format``, None as ``-``, anything else via ``str``.

    Pipes are escaped so a cell cannot split its row.
    """
    if value is None:
        text = MISSING
    elif isinstance(value, float):
        text = format(value, float_format)
    else:
        text = str(value)
    return text.replace("|", "\\|")


def markdown_table(
    header: Sequence[object],
    rows: Sequence[Sequence[object]],
    bold: set[tuple[int, int]] | None = None,
    float_format: str = ".4g",
) -> str:
    """A GitHub markdown table, no trailing newline.

    Args:
        header: one label per column (numbers are formatted like cells).
        rows: body rows, each with exactly one cell per column.
        bold: ``(row, column)`` indices into ``rows`` of cells to print in bold, e.g. the best
            value of each column (see :func:`best_in_columns`).
        float_format: format spec for float cells (``".4g"``: 0.03125, 12.35, 1.235e+04).
    """
    if not header:
        raise ValueError("header must name at least one column")
    width = len(header)
    for index, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"rows[{index}] has {len(row)} cells, the header has {width} columns")
    bold = bold or set()
    outside = sorted((r, c) for r, c in bold if not (0 <= r < len(rows) and 0 <= c < width))
    if outside:
        raise ValueError(
            f"bold cells {outside} are outside the table (rows 0..{len(rows) - 1}, columns 0..{width - 1})"
        )

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    body = [
        line(
            [
                f"**{text}**" if (r, c) in bold else text
                for c, text in enumerate(format_cell(value, float_format) for value in row)
            ]
        )
        for r, row in enumerate(rows)
    ]
    header_line = line([format_cell(label, float_format) for label in header])
    return "\n".join([header_line, "|---|" + "---:|" * (width - 1), *body])


def best_in_columns(
    rows: Sequence[Sequence[object]], columns: Sequence[int], lower_is_better: bool = True
) -> set[tuple[int, int]]:
    """``(row, column)`` of the best number in each of ``columns`` (every row tied for best), for ``bold``.

    Cells that are not real numbers (names, None, NaN) never win; a column without numbers has no best.
    """
    best = set()
    for column in columns:
        if any(not 0 <= column < len(row) for row in rows):
            raise ValueError(f"columns: {column} is not a column of every row")
        values = {
            r: float(row[column])
            for r, row in enumerate(rows)
            if isinstance(row[column], Real)
            and not isinstance(row[column], bool)
            and not math.isnan(row[column])
        }
        if values:
            target = min(values.values()) if lower_is_better else max(values.values())
            best |= {(r, column) for r, value in values.items() if value == target}
    return best
