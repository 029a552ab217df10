"""Real text to train on, by corpus name; the evaluation's held-out text is refused.

- ``essays``: Paul Graham essays from ``--essays-dir`` (prose; not shipped, their license does not
  allow it: only for users who have them);
- ``code``: Python source of the third-party packages installed in this environment (site-packages);
- ``native_code``: their C, C++, CUDA, Cython and JavaScript source, taken round-robin over packages
  (one package's headers would otherwise be nearly all of it);
- ``docs``: the long descriptions (READMEs) of the installed distributions (documentation);
- ``dialogue``: the English conversations of the ``chatterbot-corpus`` package (a held-out split
  keeps or leaves whole conversations, not whole topic files).

Never training data: what ``eval.corpora`` holds out (the benchmark's corpora, the Python standard
library and ``/usr/share``). Packages and distributions it names are left out of ``code`` and
``docs``, and every file is passed to ``eval.corpora.refuse_held_out`` before it is read;
``--text-files`` are checked the same way.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import random
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from eval.corpora import is_held_out, refuse_held_out

OWN_DISTRIBUTION = "kvp-cache"
# Files past this size are mostly generated tables or vendored bundles, not code people write.
MAX_FILE_BYTES = 200_000
MIN_DOCUMENT_CHARS = 500

Keep = Callable[[str], bool]  # which documents a reader takes


def keep_all(text: str) -> bool:
    return True


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


NATIVE_SUFFIXES = (".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh", ".pyx", ".pxd", ".js")


def code_files(suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    """Third-party source files of site-packages with these suffixes, sorted, without the held-out
    packages."""
    root = site_packages()
    packages = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".dist-info"))
    return [
        path
        for package in packages
        if package.name != "__pycache__" and not is_held_out(package)
        for path in sorted(package.rglob("*"))
        if path.suffix in suffixes
        and path.is_file()
        and "__pycache__" not in path.parts
        and MIN_DOCUMENT_CHARS <= path.stat().st_size <= MAX_FILE_BYTES
    ]


def essays(essays_dir: str | Path | None, rng: random.Random, max_chars: int | None, keep: Keep) -> list[str]:
    if essays_dir is None:
        raise ValueError(
            "corpus 'essays' needs --essays-dir: a folder of Paul Graham essays (*.txt), not shipped"
        )
    refuse_held_out([essays_dir])
    files = sorted(Path(essays_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"--essays-dir {essays_dir} holds no *.txt essays")
    return _read(files, rng, max_chars, keep)


def code(essays_dir: str | Path | None, rng: random.Random, max_chars: int | None, keep: Keep) -> list[str]:
    files = code_files()
    if not files:
        raise FileNotFoundError(f"no third-party Python source under {site_packages()}")
    return _read(files, rng, max_chars, keep)


def native_code(
    essays_dir: str | Path | None, rng: random.Random, max_chars: int | None, keep: Keep
) -> list[str]:
    by_package: dict[str, list[Path]] = {}
    for path in code_files(NATIVE_SUFFIXES):
        by_package.setdefault(path.relative_to(site_packages()).parts[0], []).append(path)
    if not by_package:
        raise FileNotFoundError(f"no third-party C/C++/CUDA/Cython/JavaScript source under {site_packages()}")
    queues = [rng.sample(files, len(files)) for _, files in sorted(by_package.items())]
    rng.shuffle(queues)
    round_robin = [queue[i] for i in range(max(map(len, queues))) for queue in queues if i < len(queue)]
    return _read(round_robin, None, max_chars, keep)


def docs(essays_dir: str | Path | None, rng: random.Random, max_chars: int | None, keep: Keep) -> list[str]:
    # Only site-packages: a default search also finds the ``*.egg-info`` that an editable install
    # leaves in the checkout root when run from there, so the corpus would depend on the working
    # directory. Our own README (our results) is not training text.
    texts = []
    installed = importlib.metadata.distributions(path=[str(site_packages())])
    for dist in sorted(installed, key=lambda d: d.metadata["Name"] or ""):
        name = dist.metadata["Name"] or ""
        if is_held_out(name) or name == OWN_DISTRIBUTION:
            continue
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if len(text) >= MIN_DOCUMENT_CHARS:
            texts.append(text)
    rng.shuffle(texts)
    return _take(texts, max_chars, keep)


def conversations() -> list[list[str]]:
    """The English conversations of ``chatterbot-corpus``, a list per topic file (in name order),
    each as ``"User: ...\nAssistant: ...\n"`` text."""
    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the dialogue corpus needs: pip install --no-deps chatterbot-corpus")
    speakers = ("User", "Assistant")
    topics = []
    for path in sorted((Path(spec.origin).parent / "data" / "english").glob("*.yml")):
        refuse_held_out([path])
        record = yaml.safe_load(path.read_text(encoding="utf-8"))
        topics.append(
            [
                "".join(f"{speakers[i % 2]}: {str(line).strip()}\n" for i, line in enumerate(conversation))
                for conversation in record.get("conversations", [])
            ]
        )
    return topics


def dialogue(
    essays_dir: str | Path | None, rng: random.Random, max_chars: int | None, keep: Keep
) -> list[str]:
    # A topic file holds a hundred conversations: ``keep`` takes or leaves each conversation.
    texts = ["\n".join(c for c in topic if keep(c)) for topic in conversations()]
    rng.shuffle(texts)
    return _take(texts, max_chars, keep_all)


CORPORA: dict[str, Callable[[str | Path, random.Random, int | None, Keep], list[str]]] = {
    "essays": essays,
    "code": code,
    "native_code": native_code,
    "docs": docs,
    "dialogue": dialogue,
}


def documents(
    name: str,
    seed: int,
    max_chars: int | None = None,
    essays_dir: str | Path | None = None,
    keep: Keep | None = None,
) -> list[str]:
    """Documents of corpus ``name`` in a seeded order, stopping once ``max_chars`` are read (None: all).

    keep: only documents it accepts are read and counted (one side of a held-out split).
    """
    if name not in CORPORA:
        raise ValueError(f"corpus must be one of {sorted(CORPORA)}, got {name!r}")
    return CORPORA[name](essays_dir, random.Random(f"{name}/{seed}"), max_chars, keep or keep_all)


def _read(files: list[Path], rng: random.Random | None, max_chars: int | None, keep: Keep) -> list[str]:
    """Read ``files`` in a seeded shuffle (``rng``) or in their order (None) up to ``max_chars``."""
    order = list(files)
    if rng is not None:
        rng.shuffle(order)

    def texts() -> Iterator[str]:
        for path in order:
            refuse_held_out([path])
            yield path.read_text(encoding="utf-8", errors="replace")

    return _take(texts(), max_chars, keep)


def _take(texts: Iterable[str], max_chars: int | None, keep: Keep) -> list[str]:
    """The non-blank texts ``keep`` accepts, in order, until ``max_chars`` are taken."""
    out, total = [], 0
    for text in texts:
        if max_chars is not None and total >= max_chars:
            break
        if text.strip() and keep(text):
            out.append(text)
            total += len(text)
    return out
