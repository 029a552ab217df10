"""Evaluation tooling run from a checkout: ``python -m eval sweep|benchmark|report ...`` and lm-eval task
configs in ``eval/tasks`` (see docs/eval.md)."""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
"""Pass to lm-eval as ``--include_path`` (or ``TaskManager(include_path=TASKS_DIR)``)."""
