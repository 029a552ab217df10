"""RULER-style synthetic tasks: sizing, determinism, answers derivable from the context, scoring."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from transformers import AutoTokenizer

from kvp_cache import ruler
from kvp_cache.models import MODELS

NEEDLE_RE = re.compile(r"One of the special magic numbers for ([\w-]+) is: (\d+)\.")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODELS["smollm2"].converted_dir())


@pytest.fixture(scope="module")
def prose(prose_dir):
    return ruler.load_haystack(prose_dir)


class WhitespaceTokenizer:
    """A tokenizer without a chat template: one token per whitespace-separated word."""

    bos_token = "<s>"
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def prompt_tokens(tokenizer, sample: ruler.Sample) -> int:
    return len(tokenizer(sample.context + "\n" + sample.question, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("task", ruler.TASKS)
@pytest.mark.parametrize("target", [1024, 4096])
def test_length_close_to_target(tokenizer, prose, task, target):
    for haystack in (None, prose):
        for sample in ruler.make_samples(task, tokenizer, target, n=2, seed=3, haystack=haystack):
            assert abs(prompt_tokens(tokenizer, sample) - target) <= 0.1 * target


def test_length_with_a_tokenizer_without_chat_template():
    tokenizer = WhitespaceTokenizer()
    sample = ruler.make_samples("niah_single", tokenizer, 800, n=1)[0]
    assert abs(prompt_tokens(tokenizer, sample) - 800) <= 80
    prefix, suffix = ruler.chat_prompt(sample, tokenizer, question_in_context=False)
    assert prefix == "<s>" + sample.context
    assert suffix == "\n" + sample.question + "\n" + sample.answer_prefix


@pytest.mark.parametrize("task", ruler.TASKS)
def test_deterministic_for_a_seed(tokenizer, task):
    first = ruler.make_samples(task, tokenizer, 512, n=3, seed=7)
    assert ruler.make_samples(task, tokenizer, 512, n=3, seed=7) == first
    # Sample i does not depend on n, and another seed gives other samples.
    assert ruler.make_samples(task, tokenizer, 512, n=1, seed=7) == first[:1]
    other = ruler.make_samples(task, tokenizer, 512, n=3, seed=8)
    assert [s.context for s in other] != [s.context for s in first]
    assert len({s.context for s in first}) == 3


def asked_keys(question: str) -> list[str]:
    query = re.match(r"What are all the special magic numbers for (.+) mentioned", question).group(1)
    return re.split(r", and |, ", query)


@pytest.mark.parametrize(
    "task, needles, asked",
    [("niah_single", 1, 1), ("niah_multikey", 4, 1), ("niah_multivalue", 4, 1), ("niah_multiquery", 4, 4)],
)
def test_niah_answers_are_the_asked_needles(tokenizer, prose, task, needles, asked):
    for sample in ruler.make_samples(task, tokenizer, 1024, n=4, seed=1, haystack=prose):
        found = NEEDLE_RE.findall(sample.context)
        assert len(found) == needles
        keys = asked_keys(sample.question)
        assert len(keys) == asked
        assert sample.answers == [value for key, value in found if key in keys]
        if task == "niah_multikey":
            assert len({key for key, _ in found}) == 4  # 3 distractor keys
        if task == "niah_multivalue":
            assert len({key for key, _ in found}) == 1 and len(set(sample.answers)) == 4
        for key in keys:
            assert key in sample.answer_prefix


def test_needle_depths_spread_over_the_context(tokenizer):
    depths = []
    for sample in ruler.make_samples("niah_single", tokenizer, 1024, n=20, seed=0):
        depths.append(NEEDLE_RE.search(sample.context).start() / len(sample.context))
    assert min(depths) < 0.25 and max(depths) > 0.75


def test_vt_answers_follow_the_chain(tokenizer, prose):
    for sample in ruler.make_samples("vt", tokenizer, 1024, n=3, seed=2, haystack=prose):
        value = re.search(r"assigned the value (\d+)", sample.question).group(1)
        holding = set()
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", sample.context):
            if rhs == value or rhs.removeprefix("VAR ") in holding:
                holding.add(name)
        assert sorted(holding) == sorted(sample.answers)
        assert len(sample.answers) == ruler.VT_HOPS + 1


@pytest.mark.parametrize("target", [1024, 4096])
def test_cwe_answers_are_the_most_common_words(tokenizer, target):
    for sample in ruler.make_samples("cwe", tokenizer, target, n=2, seed=4):
        counts = Counter(re.findall(r"\d+\. (\w+)", sample.context))
        top = counts.most_common()
        assert sorted(sample.answers) == sorted(word for word, _ in top[: ruler.CWE_COMMON])
        assert top[ruler.CWE_COMMON - 1][1] > top[ruler.CWE_COMMON][1]


def test_fwe_answers_are_the_most_frequent_coded_words(tokenizer):
    for sample in ruler.make_samples("fwe", tokenizer, 2048, n=2, seed=5):
        body = sample.context.removeprefix(ruler.FWE_CONTEXT)
        top = [(w, c) for w, c in Counter(body.split()).most_common() if w != "...."]
        assert sample.answers == [word for word, _ in top[: ruler.FWE_TOP]]
        assert top[ruler.FWE_TOP - 1][1] > top[ruler.FWE_TOP][1]


@pytest.mark.parametrize("task", ruler.TASKS)
def test_every_answer_is_in_the_context(tokenizer, task):
    for sample in ruler.make_samples(task, tokenizer, 512, n=3, seed=9):
        assert sample.answers and all(answer in sample.context for answer in sample.answers)
        assert sample.task == task


def test_score_is_the_fraction_of_answers_found():
    sample = ruler.Sample("niah_multivalue", "ctx", "q?", ["1234567", "7654321", "Apple", "x9"], "prefix")
    assert ruler.score(sample, "1234567, 7654321, apple and X9.") == 1.0
    assert ruler.score(sample, "The numbers are 1234567 and APPLE") == 0.5
    assert ruler.score(sample, "123456 7654320") == 0.0
    assert ruler.score(sample, "") == 0.0


def test_chat_prompt_splits_the_full_prompt(tokenizer):
    sample = ruler.make_samples("niah_single", tokenizer, 256, n=1)[0]
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": sample.context + "\n" + sample.question}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prefix, suffix = ruler.chat_prompt(sample, tokenizer)
    assert suffix == "" and prefix == full + sample.answer_prefix
    prefix, suffix = ruler.chat_prompt(sample, tokenizer, question_in_context=False)
    assert prefix + suffix == full + sample.answer_prefix
    assert prefix.endswith(sample.context) and sample.question not in prefix
    assert suffix.startswith("\n" + sample.question) and suffix.endswith(sample.answer_prefix)


def test_load_haystack(tmp_path, prose_dir):
    assert ruler.load_haystack(None) == ruler.NOISE
    (tmp_path / "b.txt").write_text("Second essay.")
    (tmp_path / "a.txt").write_text("First essay.")
    (tmp_path / "notes.md").write_text("Not an essay.")
    assert ruler.load_haystack(tmp_path) == "First essay.\nSecond essay."
    first = sorted(prose_dir.glob("*.txt"))[0].read_text(encoding="utf-8")
    assert ruler.load_haystack(str(prose_dir)).startswith(first + "\n")


def test_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        ruler.load_haystack(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"no \*\.txt"):
        ruler.load_haystack(tmp_path)
    with pytest.raises(ValueError, match="niah_single, niah_multikey.*fwe"):
        ruler.make_samples("niah", tokenizer, 512, n=1)
    with pytest.raises(ValueError, match="too small for task 'niah_multikey'"):
        ruler.make_samples("niah_multikey", tokenizer, 40, n=1)
    with pytest.raises(ValueError, match="context_tokens"):
        ruler.make_samples("vt", tokenizer, 0, n=1)
    with pytest.raises(ValueError, match="n must be"):
        ruler.make_samples("vt", tokenizer, 512, n=0)
    with pytest.raises(ValueError, match="haystack is empty"):
        ruler.make_samples("vt", tokenizer, 512, n=1, haystack="  ")


def window_of(sample: ruler.Sample, sentences: list[str]) -> tuple[str, ...]:
    """The haystack sentences of a sample's context, read from its facts and checked against the text."""
    window = tuple(ruler.take_sentences(sentences, sample.facts["start"], sample.facts["sentences"]))
    assert all(sentence in sample.context for sentence in window)
    return window


def ingredients(sample: ruler.Sample, sentences: list[str]) -> dict[str, set]:
    """Everything a policy could memorize from a sample, read from its text where it shows there."""
    found = {"context": {sample.context}, "answers": set(sample.answers)}
    if sample.task.startswith("niah_"):
        needles = NEEDLE_RE.findall(sample.context)
        assert {key for key, _ in needles} == set(sample.facts["keys"])
        assert {value for _, value in needles} == set(sample.facts["values"])
        found["keys"] = {key for key, _ in needles}
        found["values"] = {value for _, value in needles}
    if sample.task == "vt":
        found["values"] = set(re.findall(r"VAR [A-Z]{5} = (\d+)\.", sample.context))
        found["keys"] = set(re.findall(r"VAR ([A-Z]{5}) =", sample.context))
    if sample.task == "vt" or sample.task.startswith("niah_"):
        found["depths"] = set(sample.facts["depths"])
        found["windows"] = {window_of(sample, sentences)}
        found["starts"] = {sample.facts["start"]}
    return found


@pytest.mark.parametrize("task", ruler.TASKS)
def test_splits_share_no_sample_needle_depth_or_window(tokenizer, prose, task):
    """No evaluation (val/test) sample, needle key or value, depth, haystack window or answer equals a
    training one, with the same prose haystack for every split."""
    sentences = ruler.split_sentences(prose)
    seen: dict[str, dict[str, set]] = {}
    for split in ruler.SPLITS:
        seen[split] = {}
        for sample in ruler.make_samples(task, tokenizer, 512, n=12, seed=0, haystack=prose, split=split):
            assert sample.facts["split"] == split
            for name, items in ingredients(sample, sentences).items():
                seen[split].setdefault(name, set()).update(items)
    assert seen["train"]["context"] and seen["train"]["answers"]
    for held_out in ("val", "test"):
        for name, items in seen["train"].items():
            assert items and not items & seen[held_out][name], (task, held_out, name)
    for name, items in seen["val"].items():
        assert not items & seen["test"][name], (task, name)


def test_split_share_partitions():
    shares = [ruler.split_share(ruler.DEPTHS, split) for split in ruler.SPLITS]
    assert sorted(d for share in shares for d in share) == sorted(ruler.DEPTHS)
    assert all(len(share) >= ruler.VT_HOPS + 1 for share in shares)


def test_default_split_is_test(tokenizer):
    default = ruler.make_samples("niah_single", tokenizer, 256, n=2)
    assert default == ruler.make_samples("niah_single", tokenizer, 256, n=2, split="test")
    assert default != ruler.make_samples("niah_single", tokenizer, 256, n=2, split="train")
    with pytest.raises(ValueError, match="split must be one of train, val, test"):
        ruler.make_samples("niah_single", tokenizer, 256, n=1, split="eval")
    with pytest.raises(ValueError, match="each of the 3 splits"):
        ruler.make_samples("niah_single", tokenizer, 256, n=1, haystack="One sentence. Two.")
