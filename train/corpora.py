"""Real text to train on, by corpus name; the evaluation's held-out text is refused.

- ``essays``: the Paul Graham essays in ``../shared/data/pg_essays`` (prose);
- ``code``: Python source of the third-party packages installed in this environment (site-packages);
- ``docs``: the long descriptions (READMEs) of the installed distributions (documentation);
- ``dialogue``: the English conversations of the ``chatterbot-corpus`` package.

Never training data: the Python standard library and ``/usr/share`` (kept for independent
evaluation), and anything the benchmark holds out. Every path and distribution goes through
:func:`refuse_held_out` before it is read, and ``--text-files`` are checked the same way.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import random
import sysconfig
from collections.abc import Callable
from pathlib import Path

DEFAULT_ESSAYS = Path(__file__).resolve().parents[2] / "shared" / "data" / "pg_essays"
# Files past this size are mostly generated tables or vendored bundles, not code people write.
MAX_FILE_BYTES = 200_000
MIN_DOCUMENT_CHARS = 500


def held_out_roots() -> list[Path]:
    """Directories whose files are never training data: the standard library and /usr/share."""
    paths = sysconfig.get_paths()
    site = {Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()}
    roots = {Path(paths["stdlib"]).resolve(), Path("/usr/share")}
    # In a virtual environment platstdlib is the venv's lib/pythonX.Y, which holds site-packages:
    # only its files outside site-packages are the standard library.
    roots |= {Path(paths["platstdlib"]).resolve()} - {p.parent for p in site}
    return sorted(roots)


def refuse_held_out(path: str | Path) -> None:
    """Raise ``ValueError`` when ``path`` lies in held-out evaluation text."""
    resolved = Path(path).resolve()
    for root in held_out_roots():
        if resolved == root or root in resolved.parents:
            raise ValueError(
                f"{path} is held out for evaluation ({root}: the Python standard library and /usr/share "
                "are never training data); pick other text"
            )


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def essays(essays_dir: str | Path, rng: random.Random, max_chars: int | None) -> list[str]:
    files = sorted(Path(essays_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"--essays-dir {essays_dir} holds no *.txt essays")
    return _read(files, rng, max_chars)


def code(essays_dir: str | Path, rng: random.Random, max_chars: int | None) -> list[str]:
    root = site_packages()
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "__pycache__" not in p.parts
        and not any(part.endswith(".dist-info") for part in p.parts)
        and MIN_DOCUMENT_CHARS <= p.stat().st_size <= MAX_FILE_BYTES
    )
    if not files:
        raise FileNotFoundError(f"no third-party Python source under {root}")
    return _read(files, rng, max_chars)


def docs(essays_dir: str | Path, rng: random.Random, max_chars: int | None) -> list[str]:
    texts = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        refuse_held_out(dist.locate_file(""))
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if len(text) >= MIN_DOCUMENT_CHARS:
            texts.append(text)
    rng.shuffle(texts)
    return _take(texts, max_chars)


def dialogue(essays_dir: str | Path, rng: random.Random, max_chars: int | None) -> list[str]:
    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the dialogue corpus needs: pip install --no-deps chatterbot-corpus")
    texts = []
    for path in sorted((Path(spec.origin).parent / "data" / "english").glob("*.yml")):
        refuse_held_out(path)
        record = yaml.safe_load(path.read_text(encoding="utf-8"))
        turns = []
        for conversation in record.get("conversations", []):
            speakers = ("User", "Assistant")
            turns += [f"{speakers[i % 2]}: {str(line).strip()}" for i, line in enumerate(conversation)]
            turns.append("")
        texts.append("\n".join(turns))
    rng.shuffle(texts)
    return _take(texts, max_chars)


CORPORA: dict[str, Callable[[str | Path, random.Random, int | None], list[str]]] = {
    "essays": essays,
    "code": code,
    "docs": docs,
    "dialogue": dialogue,
}


def documents(name: str, seed: int, max_chars: int | None = None, essays_dir: str | Path = DEFAULT_ESSAYS):
    """Documents of corpus ``name`` in a seeded order, stopping once ``max_chars`` are read (None: all)."""
    if name not in CORPORA:
        raise ValueError(f"corpus must be one of {sorted(CORPORA)}, got {name!r}")
    return CORPORA[name](essays_dir, random.Random(f"{name}/{seed}"), max_chars)


def _read(files: list[Path], rng: random.Random, max_chars: int | None) -> list[str]:
    order = list(files)
    rng.shuffle(order)
    texts, total = [], 0
    for path in order:
        if max_chars is not None and total >= max_chars:
            break
        refuse_held_out(path)
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            texts.append(text)
            total += len(text)
    return texts


def _take(texts: list[str], max_chars: int | None) -> list[str]:
    out, total = [], 0
    for text in texts:
        if max_chars is not None and total >= max_chars:
            break
        out.append(text)
        total += len(text)
    return out
