"""Every bench script starts as its docstring says (``python bench/x.py``), from any folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = sorted((Path(__file__).resolve().parent.parent / "bench").glob("bench_*.py"))


@pytest.mark.parametrize("script", BENCH, ids=lambda p: p.name)
def test_bench_script_imports_and_parses_its_arguments(script, tmp_path):
    result = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
