"""Offline RULER-style synthetic long-context tasks (Hsieh et al., 2024), sized with any tokenizer.

The templates, needles and answer prefixes follow NVIDIA's RULER scripts (the set the KVP paper
trains and evaluates on, via kvpress's ``simonjegou/ruler``); everything is generated locally from a
seed, with built-in word lists instead of the ``wonderwords`` package, so nothing is downloaded.

Tasks (RULER's defaults):

- ``niah_single``: one needle "One of the special magic numbers for {key} is: {value}." in a haystack.
- ``niah_multikey``: the asked needle plus 3 distractor needles with other keys.
- ``niah_multivalue``: 4 needles with the same key; all 4 values must be returned.
- ``niah_multiquery``: 4 needles with different keys, all asked at once.
- ``vt``: variable tracking, a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) hidden in the
  haystack; return every variable holding the value.
- ``cwe``: common words extraction from a numbered word list (10 words repeated far more often).
- ``fwe``: frequent words extraction from Zipf-distributed coded words (the 3 most frequent).

The ``niah_*`` and ``vt`` tasks fill the context with ``haystack`` sentences (Paul Graham essays via
:func:`load_haystack`, or RULER's "noise" sentences), starting at a seeded random sentence and
wrapping around. Each sample's context plus question is sized to about ``context_tokens`` tokens
of the given tokenizer (without the chat template, which :func:`chat_prompt` adds).

Splits (``train``, ``val``, ``test``) never share a sample, nor anything a policy could memorize:
the split name is part of every sample's seed, and each split draws from its own share of every
ingredient (:func:`split_share`): the key adjectives, the needle values (by residue mod 3), the
needle depths, the haystack start sentences (a contiguous third each), the ``vt`` variable names'
first letters, the ``cwe`` common words and the ``fwe`` answer words' first letters. Training uses
``train``, checkpoint selection ``val``, and every reported evaluation ``test``.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SPLITS = ("train", "val", "test")
"""Disjoint sample splits: training, checkpoint selection, reported evaluation."""

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

NIAH_CONTEXT = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NIAH_QUESTION = "What are all the special magic numbers for {query} mentioned in the provided text?"
NIAH_ANSWER_PREFIX = "The special magic numbers for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic numbers for {key} is: {value}."

VT_CONTEXT = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_ANSWER_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {count} variables are "
    "assigned the value {value}, they are:"
)

CWE_CONTEXT = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = "Question: What are the {count} most common words in the above list?"
CWE_ANSWER_PREFIX = "Answer: The top {count} words that appear most often in the list are:"

FWE_CONTEXT = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. "
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"

# RULER defaults.
MULTI_NEEDLES = 4  # keys in niah_multikey / niah_multiquery, values in niah_multivalue
VT_HOPS = 4  # the chain has VT_HOPS + 1 variables
CWE_COMMON = 10
FWE_TOP = 3
FWE_VOCAB = 2000
FWE_WORD_LEN = 6
FWE_ALPHA = 2.0
FWE_ZETA = math.pi**2 / 6  # Riemann zeta(FWE_ALPHA): normalizes the Zipf counts to about `total` words
DEPTHS = tuple(round(i * 100 / 39) for i in range(40))  # needle depths in percent, as in RULER
LENGTH_TOLERANCE = 0.02  # the sizing loop stops within 2% of the target

# The cwe vocabulary (common English adjectives, nouns and verbs), kept as data beside this module.
_WORD_LISTS = json.loads(Path(__file__).with_name("ruler_words.json").read_text(encoding="utf-8"))
ADJECTIVES, NOUNS, VERBS = (_WORD_LISTS[kind] for kind in ("adjectives", "nouns", "verbs"))
WORDS = tuple(dict.fromkeys(ADJECTIVES + NOUNS + VERBS))  # the cwe vocabulary, deduplicated


@dataclass
class Sample:
    """One task instance.

    context: the task instruction and the long text (what a compressed cache should summarize).
    question: the question asked about it.
    answers: every string the reply must contain (RULER's ``string_match_all``).
    answer_prefix: the start of the reply, put after the chat template's generation prompt.
    """

    task: str
    context: str
    question: str
    answers: list[str]
    answer_prefix: str
    facts: dict = field(default_factory=dict)
    """What the sample was drawn from, to check split disjointness: ``split``, and per task
    ``keys``/``values`` (needles), ``depths`` (percent), ``start``/``sentences`` (haystack window),
    ``common`` (cwe), ``names`` (vt)."""


def load_haystack(essays_dir: str | Path | None) -> str:
    """The concatenated ``*.txt`` essays of ``essays_dir`` (sorted by name), or RULER's noise text if None."""
    if essays_dir is None:
        return NOISE
    path = Path(essays_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"essays_dir {str(path)!r} is not a directory (expected Paul Graham essays *.txt)"
        )
    files = sorted(path.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"essays_dir {str(path)!r} holds no *.txt files")
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def make_samples(
    task: str,
    tokenizer,
    context_tokens: int,
    n: int,
    seed: int = 0,
    haystack: str | None = None,
    split: str = "test",
) -> list[Sample]:
    """``n`` samples of ``task``, each with context + question of about ``context_tokens`` tokens.

    Samples are a pure function of (split, task, tokenizer, context_tokens, seed, haystack, sample
    index): sample ``i`` is the same whatever ``n`` is. ``haystack`` (default RULER's noise) fills
    the ``niah_*`` and ``vt`` contexts; needles go at seeded random depths. ``split`` is ``train``
    (training data), ``val`` (checkpoint selection) or ``test`` (reported evaluation, the default);
    no two splits share a needle key or value, a depth, a haystack start or an answer word.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"context_tokens must be an int >= 1, got {context_tokens!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    sentences = split_sentences(NOISE if haystack is None else haystack)
    if not sentences:
        raise ValueError("haystack is empty; pass None for RULER's noise text")
    if len(sentences) < len(SPLITS):
        raise ValueError(
            f"haystack has {len(sentences)} sentences; each of the {len(SPLITS)} splits needs its own start"
        )
    builder = _BUILDERS[task]
    samples = []
    for index in range(n):
        draw = _Draw(split, f"kvp-ruler/{split}/{task}/{seed}/{index}")
        sample = builder(draw, sentences, tokenizer, context_tokens)
        sample.facts["split"] = split
        samples.append(sample)
    return samples


def split_share(items: list | tuple, split: str) -> list:
    """``split``'s share of ``items``: every third item, offset by the split's index in :data:`SPLITS`.

    The three shares are disjoint and together cover ``items``.
    """
    part = SPLITS.index(split)
    return [item for i, item in enumerate(items) if i % len(SPLITS) == part]


class _Draw:
    """A sample's seeded random draws, each restricted to its split's share."""

    def __init__(self, split: str, sample_seed: str):
        self.split = split
        self.part = SPLITS.index(split)
        self.rng = random.Random(sample_seed)

    def number(self, low: int, high: int) -> int:
        """A uniform int in ``[low, high)`` congruent to the split's index mod 3."""
        first = low + (self.part - low) % len(SPLITS)
        return self.rng.randrange(first, high, len(SPLITS))

    def depths(self, count: int) -> list[int]:
        """``count`` distinct needle depths (percent, sorted) from the split's share of :data:`DEPTHS`."""
        return sorted(self.rng.sample(split_share(DEPTHS, self.split), count))

    def start(self, sentences: list[str]) -> int:
        """A haystack start sentence inside the split's contiguous third of ``sentences``."""
        size = len(sentences)
        return self.rng.randrange(size * self.part // len(SPLITS), size * (self.part + 1) // len(SPLITS))

    def letter(self, alphabet: str) -> str:
        """A letter of the split's share of ``alphabet``."""
        return self.rng.choice(split_share(alphabet, self.split))


def chat_prompt(sample: Sample, tokenizer, question_in_context: bool = True) -> tuple[str, str]:
    """``(prefix, suffix)``: ``prefix + suffix`` is the full prompt, ``prefix`` what gets compressed.

    The full prompt is the chat template over one user turn ``context + "\\n" + question``, with
    the generation prompt, followed by ``answer_prefix`` (as kvpress does). With
    ``question_in_context=True`` (the paper's RULER protocol: the question is prefilled and
    compressed with the context) ``prefix`` is the whole prompt and ``suffix`` is empty. With
    ``False`` ``prefix`` ends right after the context, and ``suffix`` holds the question, the end of
    the turn, the generation prompt and the answer prefix (asked after compression).
    Tokenize both with ``add_special_tokens=False``: the template already holds them.
    """
    user = sample.context + "\n" + sample.question
    if getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
        full += sample.answer_prefix
    else:
        full = (getattr(tokenizer, "bos_token", None) or "") + user + "\n" + sample.answer_prefix
    if question_in_context:
        return full, ""
    cut = full.find(sample.context)
    if cut < 0:
        raise ValueError("the chat template altered the context text; cannot split the prompt after it")
    cut += len(sample.context)
    return full[:cut], full[cut:]


def score(sample: Sample, prediction: str) -> float:
    """RULER's string match: the fraction of ``sample.answers`` found in ``prediction``, case-insensitive."""
    prediction = prediction.lower()
    return sum(answer.lower() in prediction for answer in sample.answers) / len(sample.answers)


def gold_answer_ids(sample: Sample, tokenizer) -> list[int]:
    """The gold answer as the model would write it after ``answer_prefix``, ending with EOS: the
    teacher-forced future of training traces and of the benchmark's oracle."""
    ids = tokenizer(" " + ", ".join(sample.answers) + ".", add_special_tokens=False)["input_ids"]
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


# ----------------------------------------------------------------------------------------------
# Builders: each returns one sample sized to the target, from a string seed.


def split_sentences(text: str) -> list[str]:
    """Split on sentence ends, with whitespace collapsed (essays wrap lines mid-sentence)."""
    return [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def take_sentences(sentences: list[str], start: int, count: int) -> list[str]:
    """``count`` sentences from ``start``, wrapping around the haystack."""
    return [sentences[(start + i) % len(sentences)] for i in range(count)]


def _niah(task: str) -> Callable:
    def build(draw: _Draw, sentences: list[str], tokenizer, target: int) -> Sample:
        rng = draw.rng
        num_keys = 1 if task in ("niah_single", "niah_multivalue") else MULTI_NEEDLES
        num_values = MULTI_NEEDLES if task == "niah_multivalue" else 1
        num_queries = MULTI_NEEDLES if task == "niah_multiquery" else 1
        adjectives = split_share(ADJECTIVES, draw.split)
        keys = _distinct(rng, num_keys, lambda: f"{rng.choice(adjectives)}-{rng.choice(NOUNS)}")
        values = _distinct(rng, num_keys * num_values, lambda: str(draw.number(10**6, 10**7)))
        needles = [(key, values[k * num_values + v]) for k, key in enumerate(keys) for v in range(num_values)]
        rng.shuffle(needles)  # so the asked needle sits anywhere among the distractors
        depths = draw.depths(len(needles))
        asked = keys[:num_queries]
        answers = [value for key, value in needles if key in asked]
        start = draw.start(sentences)
        query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
        question = NIAH_QUESTION.format(query=query)

        def context(count: int) -> str:
            text = take_sentences(sentences, start, count)
            # Insert from the deepest so earlier indices stay valid.
            for depth, (key, value) in sorted(zip(depths, needles, strict=True), reverse=True):
                text.insert(int(count * depth / 100), NEEDLE.format(key=key, value=value))
            return NIAH_CONTEXT + " ".join(text)

        count = _fit(context, question, tokenizer, target, task)
        facts = {"keys": keys, "values": values, "depths": depths, "start": start, "sentences": count}
        return Sample(task, context(count), question, answers, NIAH_ANSWER_PREFIX.format(query=query), facts)

    return build


def _vt(draw: _Draw, sentences: list[str], tokenizer, target: int) -> Sample:
    rng = draw.rng
    names = _distinct(
        rng,
        VT_HOPS + 1,
        lambda: draw.letter(string.ascii_uppercase) + "".join(rng.choices(string.ascii_uppercase, k=4)),
    )
    value = str(draw.number(10000, 100000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j + 1]} = VAR {names[j]}." for j in range(VT_HOPS)]
    depths = draw.depths(len(chain))
    start = draw.start(sentences)
    question = VT_QUESTION.format(value=value)

    def context(count: int) -> str:
        text = take_sentences(sentences, start, count)
        # The chain stays in order: statement j goes at depth_j percent of the filler.
        for j in reversed(range(len(chain))):
            text.insert(int(count * depths[j] / 100), chain[j])
        return VT_CONTEXT + " ".join(text)

    count = _fit(context, question, tokenizer, target, "vt")
    facts = {"names": names, "values": [value], "depths": depths, "start": start, "sentences": count}
    prefix = VT_ANSWER_PREFIX.format(count=len(names), value=value)
    return Sample("vt", context(count), question, names, prefix, facts)


def _cwe(draw: _Draw, sentences: list[str], tokenizer, target: int) -> Sample:
    # RULER repeats the common words 30x and the others 3x (6x / 1x below 4K tokens). When the
    # vocabulary runs short for long contexts, both repeat counts grow by the same factor.
    common_repeats, uncommon_repeats = (30, 3) if target >= 4096 else (6, 1)
    question = CWE_QUESTION.format(count=CWE_COMMON)
    uncommon_available = len(WORDS) - CWE_COMMON
    # The answers come from the split's share of the vocabulary; the filler words from all of it.
    common = draw.rng.sample(split_share(WORDS, draw.split), CWE_COMMON)
    others = draw.rng.sample([w for w in WORDS if w not in common], uncommon_available)
    listing_seed = draw.rng.random()

    def words(entries: int) -> list[str]:
        scale = 1
        while CWE_COMMON * common_repeats * scale + uncommon_available * uncommon_repeats * scale < entries:
            scale += 1
        common_n, uncommon_n = common_repeats * scale, uncommon_repeats * scale
        uncommon = others[: max(0, entries - CWE_COMMON * common_n) // uncommon_n]
        listing = common * common_n + uncommon * uncommon_n
        random.Random(listing_seed).shuffle(listing)
        return listing

    def context(entries: int) -> str:
        return CWE_CONTEXT + " ".join(f"{i + 1}. {word}" for i, word in enumerate(words(entries)))

    entries = _fit(context, question, tokenizer, target, "cwe", minimum=CWE_COMMON * common_repeats)
    facts = {"common": common}
    return Sample(
        "cwe", context(entries), question, common, CWE_ANSWER_PREFIX.format(count=CWE_COMMON), facts
    )


def _fwe(draw: _Draw, sentences: list[str], tokenizer, target: int) -> Sample:
    # RULER: a vocabulary of random 6-letter coded words whose counts follow Zipf(alpha = 2); the
    # top-ranked "word" is the noise token '....', so the answers are ranks 2-4. The answers start
    # with a letter of the split's share of the alphabet.
    rng = draw.rng
    lowercase = string.ascii_lowercase
    top = _distinct(
        rng, FWE_TOP, lambda: draw.letter(lowercase) + "".join(rng.choices(lowercase, k=FWE_WORD_LEN - 1))
    )
    rest = _distinct(
        rng, FWE_VOCAB - 1 - FWE_TOP, lambda: "".join(rng.choices(lowercase, k=FWE_WORD_LEN)), exclude=top
    )
    vocab = ["...."] + top + rest
    shuffle_seed = rng.random()

    def context(total: int) -> str:
        counts = [int(total * k**-FWE_ALPHA / FWE_ZETA) for k in range(1, FWE_VOCAB + 1)]
        text = [word for word, c in zip(vocab, counts, strict=True) for _ in range(c)]
        random.Random(shuffle_seed).shuffle(text)
        return FWE_CONTEXT + " ".join(text)

    # The third answer needs a count > the fourth's: about 60 words at least.
    text = context(_fit(context, FWE_QUESTION, tokenizer, target, "fwe", minimum=64))
    return Sample("fwe", text, FWE_QUESTION, top, FWE_ANSWER_PREFIX, {"values": top})


def _distinct(rng: random.Random, count: int, draw: Callable[[], str], exclude=()) -> list[str]:
    """``count`` distinct draws, none of them in ``exclude``."""
    out: dict[str, None] = {}
    while len(out) < count:
        item = draw()
        if item not in exclude:
            out[item] = None
    return list(out)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _fit(
    context: Callable[[int], str], question: str, tokenizer, target: int, task: str, minimum: int = 0
) -> int:
    """The ``size`` >= ``minimum`` whose ``context(size)`` + question is closest to ``target`` tokens.

    ``size`` counts filler units (sentences, list entries, words); the token count grows about
    linearly with it, so a few secant steps from a linear estimate land within LENGTH_TOLERANCE.
    """

    def length(size: int) -> int:
        return _count(tokenizer, context(size) + "\n" + question)

    base = length(minimum)
    if base > target * (1 + LENGTH_TOLERANCE) + 8:
        raise ValueError(
            f"context_tokens={target} is too small for task {task!r}: its shortest prompt has {base} tokens"
        )
    probe = minimum + 16
    measured = {minimum: base, probe: length(probe)}
    size = probe
    for _ in range(8):
        per_unit = max((measured[size] - base) / (size - minimum), 1e-3)
        size = max(minimum, minimum + math.floor((target - base) / per_unit))
        if size not in measured:
            measured[size] = length(size)
        if abs(measured[size] - target) <= LENGTH_TOLERANCE * target or size == minimum:
            break
    return min(measured, key=lambda s: (abs(measured[s] - target), s))


_BUILDERS: dict[str, Callable[[_Draw, list[str], object, int], Sample]] = {
    **{task: _niah(task) for task in TASKS if task.startswith("niah_")},
    "vt": _vt,
    "cwe": _cwe,
    "fwe": _fwe,
}
