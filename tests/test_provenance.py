"""Provenance records any machine can read: commands relative to the repository, outside data by content hash."""

from __future__ import annotations

import re
import shutil
import sys
import types

import pytest

from kvp_cache.provenance import REPO, content_sha256, portable_command, portable_path

# Where the committed records live (the list), and what an absolute path of a machine looks like.
RECORDS = ["README.md", "docs", "eval/results", "bench/results", "kvp_cache/policies"]
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|tmp|root|home|Users|mnt|scratch)/[\w.-]")


def test_repository_scripts_become_module_or_relative_commands():
    assert portable_command([str(REPO / "eval" / "__main__.py"), "benchmark"]) == "python -m eval benchmark"
    assert portable_command([str(REPO / "train" / "__main__.py"), "fit"]) == "python -m train fit"
    assert portable_command([str(REPO / "bench" / "bench_policy.py"), "--repeats", "3"]) == (
        "python bench/bench_policy.py --repeats 3"
    )
    assert (
        portable_command(["/somewhere/.venv/bin/kvp-lm-eval", "--model", "kvp"]) == "kvp-lm-eval --model kvp"
    )
    assert portable_command(["python -m eval", "sweep"]) == "python -m eval sweep"


def test_a_module_run_is_recorded_as_one(monkeypatch):
    script = REPO / "eval" / "headroom.py"
    main = types.SimpleNamespace(__spec__=types.SimpleNamespace(name="eval.headroom", origin=str(script)))
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert portable_command([str(script), "--threads", "1"]) == "python -m eval.headroom --threads 1"
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=None))
    assert portable_command([str(script), "--threads", "1"]) == "python eval/headroom.py --threads 1"


def test_paths_inside_stay_relative_and_outside_data_is_named_by_content(tmp_path):
    assert portable_path(str(REPO / "kvp_cache" / "policies")) == "kvp_cache/policies"
    data = tmp_path / "a" / "pg_essays"
    data.mkdir(parents=True)
    (data / "one.txt").write_text("First essay.")
    digest = content_sha256(data)[:12]
    assert portable_path(str(data)) == f"pg_essays@sha256:{digest}"
    # The same content elsewhere gets the same name; other content another one.
    copy = shutil.copytree(data, tmp_path / "b" / "pg_essays")
    assert portable_path(str(copy)) == f"pg_essays@sha256:{digest}"
    (copy / "one.txt").write_text("Edited essay.")
    assert portable_path(str(copy)) != f"pg_essays@sha256:{digest}"
    assert portable_path(str(tmp_path / "runs" / "s3" / "fit-400")) == ".../s3/fit-400"  # not there yet


def test_every_argument_form_is_made_portable(tmp_path):
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text("{}")
    policy = portable_path(str(tmp_path / "policy"))
    command = portable_command(
        ["python -m train", "downstream", f"--traces={tmp_path}/traces", "--policy", f"a={tmp_path}/policy",
         "--text-files", f"{tmp_path}/policy,bench", "--budgets", "0.1,0.25", "--methods", "kvp"]
    )  # fmt: skip
    assert command == (
        f"python -m train downstream --traces=.../{tmp_path.name}/traces --policy a={policy} "
        f"--text-files {policy},bench --budgets 0.1,0.25 --methods kvp"
    )
    assert str(tmp_path) not in command


@pytest.mark.parametrize("root", RECORDS)
def test_committed_records_hold_no_machine_path(root):
    paths = [REPO / root] if (REPO / root).is_file() else sorted((REPO / root).rglob("*"))
    found = [
        f"{path.relative_to(REPO)}: {match.group(0)}"
        for path in paths
        if path.is_file() and path.suffix in {".md", ".json", ".jsonl"}
        for match in MACHINE_PATH.finditer(path.read_text(encoding="utf-8"))
    ]
    assert not found, found[:10]


def test_no_code_or_default_reads_beside_the_checkout():
    """Nothing the repository runs names a sibling folder of the checkout (the CI machines' shared/)."""
    offenders = [
        str(path.relative_to(REPO))
        for folder in ("kvp_cache", "eval", "train", "bench", "tests", "scripts", ".ci")
        for path in (REPO / folder).rglob("*")
        if path.is_file()
        and path.suffix in {".py", ".sh", ".yaml", ""}
        and re.search(r"\.\./shared|parents\[2\]", path.read_text(encoding="utf-8", errors="ignore"))
    ]
    assert offenders == [], offenders
