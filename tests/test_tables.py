"""The shared markdown table renderer: layout, number formats, bold cells and bad input."""

from __future__ import annotations

import pytest

from kvp_cache.tables import best_in_columns, markdown_table


def test_names_left_numbers_right_floats_short():
    table = markdown_table(["method", 64, 0.5], [["kvp", 0.125, 1 / 3], ["knorm", 2, None]])
    assert table.splitlines() == [
        "| method | 64 | 0.5 |",
        "|---|---:|---:|",
        "| kvp | 0.125 | 0.3333 |",
        "| knorm | 2 | - |",
    ]


def test_float_format_strings_and_pipes():
    table = markdown_table(["a|b", "x"], [["full cache", 0.456], ["r", "45.6 %"]], float_format=".1%")
    assert table.splitlines()[0] == "| a\\|b | x |"
    assert table.splitlines()[2:] == ["| full cache | 45.6% |", "| r | 45.6 % |"]


def test_bold_marks_the_best_of_each_column():
    rows = [["kvp", 0.1, 0.9], ["knorm", 0.3, 0.9], ["random", 0.2, float("nan")]]
    lower = best_in_columns(rows, columns=[1, 2])
    assert lower == {(0, 1), (0, 2), (1, 2)}  # ties all win; NaN never does
    assert best_in_columns(rows, columns=[1], lower_is_better=False) == {(1, 1)}
    assert best_in_columns(rows, columns=[0]) == set()  # names are not numbers
    lines = markdown_table(["method", "a", "b"], rows, bold=lower).splitlines()
    assert lines[2] == "| kvp | **0.1** | **0.9** |" and lines[3] == "| knorm | 0.3 | **0.9** |"
    assert lines[4] == "| random | 0.2 | nan |"


@pytest.mark.parametrize(
    "header, rows, bold, message",
    [
        ([], [], None, "header must name at least one column"),
        (["a", "b"], [["x", 1], ["y"]], None, r"rows\[1\] has 1 cells, the header has 2 columns"),
        (["a", "b"], [["x", 1]], {(1, 1)}, r"bold cells \[\(1, 1\)\] are outside the table"),
    ],
)
def test_bad_tables_are_refused(header, rows, bold, message):
    with pytest.raises(ValueError, match=message):
        markdown_table(header, rows, bold)


def test_best_in_columns_refuses_a_missing_column():
    with pytest.raises(ValueError, match="columns: 3 is not a column"):
        best_in_columns([["x", 1]], columns=[3])
