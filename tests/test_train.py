"""The training module: collection against brute-force attention, the reward, the PL policy, fit,
evaluate, and resumability. Tiny random models and synthetic traces only (seconds)."""

from __future__ import annotations

import copy
import importlib.metadata
import itertools
import json
import math
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from kvp_cache.policy import HeadAgents, KVPolicy, load_policy
from kvp_cache.targets import attention_modules
from train import collect, corpora, data, evaluate, fit, reward, rl
from train.batch import pad_batch
from train.traces import TraceSplit, shard_dir, write_shard

REPO = Path(__file__).resolve().parents[1]

PROMPT, FUTURE = 40, 6


def random_examples(count: int, seed: int, future: bool = True) -> list[data.Example]:
    g = torch.Generator().manual_seed(seed)
    return [
        data.Example(
            f"rand/{i}",
            "rand",
            torch.randint(0, 256, (PROMPT,), generator=g).tolist(),
            torch.randint(0, 256, (FUTURE,), generator=g).tolist() if future else None,
        )
        for i in range(count)
    ]


@pytest.fixture
def traces(tmp_path, llama):
    splits = {"train": random_examples(3, 0), "val": random_examples(2, 1)}
    collect.write_traces(llama, tmp_path, splits, {"val"}, shard_size=2, max_new_tokens=4, settings={"t": 1})
    return tmp_path, splits


def test_collect_matches_brute_force_attention(traces, llama):
    root, splits = traces
    val = TraceSplit(root, "val")
    assert [s["uid"] for s in val.samples] == [e.uid for e in splits["val"]]
    example = splits["val"][1]
    with torch.no_grad():
        out = llama(
            torch.tensor([example.prompt_ids + example.future_ids]), output_attentions=True, use_cache=True
        )
    for layer, attention in enumerate(out.attentions):
        stored = val.layer(layer)[1]
        assert stored.keys.shape == (2, PROMPT, 16) and stored.keys.dtype == torch.float16
        future_rows = attention[0, :, PROMPT:, :PROMPT]  # [q_heads=4, FUTURE, PROMPT]
        expected = future_rows.reshape(2, 2, FUTURE, PROMPT).amax(dim=1).sum(dim=1)  # max over the group
        torch.testing.assert_close(stored.importance, expected, atol=1e-5, rtol=1e-4)
        cache_keys = out.past_key_values.layers[layer].keys[0, :, :PROMPT]
        torch.testing.assert_close(stored.keys.float(), cache_keys, atol=2e-3, rtol=2e-3)
        assert set(stored.scores) == set(collect.query_aware_methods())
        assert all(s.shape == (2, PROMPT) for s in stored.scores.values())
    assert TraceSplit(root, "train").layer(0)[0].scores == {}


def test_joined_splits_read_as_one(traces):
    root, splits = traces
    joined = TraceSplit(root, "train+val")
    assert [s["uid"] for s in joined.samples] == [e.uid for e in splits["train"] + splits["val"]]
    assert len(joined.layer(0)) == 5
    with pytest.raises(FileNotFoundError, match="extra"):
        TraceSplit(root, "train+extra")
    meta_file = next((root / "val").glob("shard_*")) / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert "layer_indices" in meta["model"]
    old_format = {k: v for k, v in meta["model"].items() if k != "layer_indices"}  # traced every layer
    meta_file.write_text(json.dumps(meta | {"model": old_format}))
    assert len(TraceSplit(root, "train+val")) == 5
    meta["model"] = {**meta["model"], "num_layers": 99}
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="mixes models"):
        TraceSplit(root, "train+val")


def test_collect_resumes_and_generates(tmp_path, llama):
    splits = {"train": random_examples(3, 0, future=False)}
    collect.write_traces(llama, tmp_path, splits, set(), shard_size=2, max_new_tokens=3, settings={"t": 1})
    samples = TraceSplit(tmp_path, "train").samples
    assert [s["future_tokens"] for s in samples] == [3, 3, 3]  # greedy answers (random model: no EOS)
    first, second = shard_dir(tmp_path, "train", 0), shard_dir(tmp_path, "train", 1)
    stamp = (first / "layer_00.safetensors").stat().st_mtime_ns
    (second / "meta.json").unlink()  # an interrupted shard
    collect.write_traces(llama, tmp_path, splits, set(), shard_size=2, max_new_tokens=3, settings={"t": 1})
    assert (first / "layer_00.safetensors").stat().st_mtime_ns == stamp
    assert (second / "meta.json").exists()
    with pytest.raises(ValueError, match="other settings"):
        collect.write_traces(
            llama, tmp_path, splits, set(), shard_size=2, max_new_tokens=3, settings={"t": 2}
        )


def test_value_importance_and_question_after_match_brute_force(llama):
    """Targets over a future made of question tokens + answer, against output_attentions."""
    g = torch.Generator().manual_seed(5)
    prompt, question, answer = (torch.randint(0, 256, (k,), generator=g).tolist() for k in (30, 5, 4))
    example = data.Example("q/0", "q", prompt, answer, question_ids=question)
    modules = attention_modules(llama)
    trace = collect.trace_example(llama, modules, example, [], only_correct=False)
    assert trace.future_tokens == 9
    with torch.no_grad():
        out = llama(torch.tensor([prompt + question + answer]), output_attentions=True, use_cache=True)
    for layer, attention in enumerate(out.attentions):
        rows = attention[0, :, 30:, :30]  # [q_heads=4, 9, 30]
        values = out.past_key_values.layers[layer].values[0, :, :30]  # [kv_heads=2, 30, 16]
        o_proj = modules[layer].o_proj.weight.view(64, 4, 16)
        norms = torch.stack(
            [(values[g // 2] @ o_proj[:, g].T).norm(dim=-1) for g in range(4)]
        )  # [q_heads, 30]: ||W_o^g v_i||
        expected_attention = rows.reshape(2, 2, 9, 30).amax(dim=1).sum(dim=1)
        expected_value = (rows * norms[:, None]).reshape(2, 2, 9, 30).amax(dim=1).sum(dim=1)
        stored = trace.layers[layer]
        torch.testing.assert_close(stored["importance"], expected_attention, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(stored["value_importance"], expected_value, atol=1e-5, rtol=1e-4)


class ByteTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}

    def decode(self, ids):
        return bytes(i for i in ids if i).decode(errors="replace")


def test_only_correct_keeps_answered_samples_and_skips_the_rest(tmp_path, llama):
    from kvp_cache import ruler

    tokenizer = ByteTokenizer()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 256, (24,), generator=g).tolist() for _ in range(3)]
    modules = attention_modules(llama)
    cache_logits = []
    for ids in prompts:  # what the full cache answers greedily, to build one right and two wrong samples
        trace = collect.trace_example(
            llama, modules, data.Example("x", "x", ids, None), [], max_new_tokens=3, only_correct=False
        )
        cache_logits.append(tokenizer.decode(trace.answer_ids))
    answers = [[cache_logits[0]], ["\x01never"], ["\x01never"]]
    examples = [
        data.Example(f"t/{i}", "t", ids, [7, 8], sample=ruler.Sample("t", "", "", a, ""))
        for i, (ids, a) in enumerate(zip(prompts, answers, strict=True))
    ]
    collect.write_traces(llama, tmp_path, {"train": examples}, set(), 2, 3, {"t": 1}, tokenizer)
    split = TraceSplit(tmp_path, "train")
    assert [s["uid"] for s in split.samples] == ["t/0"]
    assert [s["uid"] for s in split.skipped] == ["t/1", "t/2"]
    assert split.samples[0]["future_tokens"] == 2  # the gold future, not the greedy answer
    assert len(split.layer(0)) == 1


def test_corpora_refuse_held_out_text():
    import json as stdlib_json

    from eval.corpora import CORPORA, is_held_out

    with pytest.raises(ValueError, match="held out|standard library"):
        data.read_text_files([stdlib_json.__file__])
    files = corpora.code_files()
    assert files and not any(is_held_out(path) for path in files)
    held_out_packages = [corpora.site_packages() / c.package.split(".")[0] for c in CORPORA.values()]
    installed = [p for p in held_out_packages if p.is_dir()]
    assert not any(p in path.parents for p in installed for path in files)
    code = corpora.documents("code", seed=0, max_chars=50_000)
    assert code and sum(map(len, code)) >= 50_000
    assert code == corpora.documents("code", seed=0, max_chars=50_000)
    assert corpora.documents("docs", seed=0, max_chars=10_000)
    native = corpora.code_files(corpora.NATIVE_SUFFIXES)
    assert native and not any(is_held_out(path) or path.suffix == ".py" for path in native)
    assert not any(p in path.parents for p in installed for path in native)
    assert corpora.documents("native_code", seed=0, max_chars=20_000)
    with pytest.raises(ValueError, match="corpus must be one of"):
        corpora.documents("stdlib", seed=0)


def test_docs_corpus_is_the_same_from_any_directory(tmp_path, monkeypatch):
    """Run from the checkout root, a default metadata search also finds its ``*.egg-info``: the docs
    corpus must not change with the working directory, and never holds our own README."""
    monkeypatch.syspath_prepend(str(tmp_path))
    egg = tmp_path / "kvp_cache.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: kvp-cache-copy\n\n" + "our readme " * 200)
    texts = corpora.documents("docs", seed=0)
    own = importlib.metadata.distribution("kvp-cache").metadata.get_payload() or ""
    assert texts and not any("our readme" in t or (own and t == own) for t in texts)
    monkeypatch.chdir(tmp_path)
    assert corpora.documents("docs", seed=0) == texts


def test_dialogue_is_held_out_by_conversation():
    """The dialogue corpus has 21 topic files; a held-out split takes whole conversations from all of them."""
    pytest.importorskip("chatterbot_corpus")

    def held(text: str) -> bool:
        return data.is_held_out_document(text, 0.1)

    topics = corpora.conversations()
    everything = [c for topic in topics for c in topic]
    assert len(topics) == 21 and len(everything) > 1000
    assert 0.05 < sum(map(held, everything)) / len(everything) < 0.15
    for keep in (held, lambda text: not held(text)):
        side = {"\n".join(c for c in topic if keep(c)) for topic in topics} - {""}
        assert sorted(corpora.documents("dialogue", seed=0, keep=keep)) == sorted(side)
        assert len(side) >= 15  # conversations of most topics, not a few whole topics


def test_log_uniform_lengths_and_synthetic_examples(prose_dir):
    import random

    rng = random.Random(0)
    lengths = [data.log_uniform_length(rng, 512, 4096) for _ in range(2000)]
    assert min(lengths) >= 512 and max(lengths) <= 4096
    below = sum(n < 1448 for n in lengths) / len(lengths)  # 1448 ~ sqrt(512 * 4096): the median
    assert 0.45 < below < 0.55
    with pytest.raises(ValueError, match="low <= high"):
        data.log_uniform_length(rng, 10, 5)
    tokenizer = ByteTokenizer()
    inside = data.synthetic_examples(tokenizer, 2, (300, 600), 0, prose_dir, ["niah_single"])
    after = data.synthetic_examples(
        tokenizer, 2, (300, 600), 0, prose_dir, ["niah_single"], question_after=True
    )
    for a, b in zip(inside, after, strict=True):
        answer = tokenizer.decode(a.future_ids)
        assert answer.strip(" .") == ", ".join(a.sample.answers)  # the gold answer, teacher-forced
        assert a.question_ids == [] and b.question_ids
        question = tokenizer.decode(b.question_ids)
        assert b.sample.question in question and b.sample.question not in tokenizer.decode(b.prompt_ids)


def test_split_and_text_windows():
    examples = random_examples(20, 0)
    split = data.split_examples(examples, 0.15, seed=3)
    assert len(split["val"]) == 3 and len(split["train"]) == 17
    assert not {e.uid for e in split["val"]} & {e.uid for e in split["train"]}
    assert split == data.split_examples(examples, 0.15, seed=3)

    windows = data.text_examples(ByteTokenizer(), ["abcdefgh" * 10, "xyz" * 10], 5, (12, 12), (4, 4), seed=0)
    assert all(len(w.prompt_ids) == 12 and len(w.future_ids) == 4 for w in windows)
    with pytest.raises(ValueError, match="fewer than"):
        data.text_examples(ByteTokenizer(), ["short"], 1, (12, 12), (4, 4), seed=0)


def test_text_windows_never_share_a_token():
    """Windows cut from one stream are disjoint, so the val split never overlaps the train split."""
    rng = random.Random(0)
    documents = ["".join(chr(rng.randrange(33, 123)) for _ in range(97)) for _ in range(40)]

    def overlapping(windows) -> bool:  # the random stream repeats no 12-gram, so shared ones mean overlap
        grams = [
            {tuple((w.prompt_ids + w.future_ids)[i : i + 12]) for i in range(len(w.prompt_ids) - 11)}
            for w in windows
        ]
        return sum(len(g) for g in grams) > len(set().union(*grams))

    legacy = []
    for seed in range(5):
        windows = data.text_examples(ByteTokenizer(), documents, 30, (40, 100), (8, 20), seed=seed)
        assert len(windows) == 30 and not overlapping(windows)
        legacy.append(
            overlapping(
                data.text_examples(ByteTokenizer(), documents, 30, (40, 100), (8, 20), seed, disjoint=False)
            )
        )
    assert any(legacy)  # the old placement overlapped
    with pytest.raises(ValueError, match="fewer than 300 disjoint windows"):
        data.text_examples(ByteTokenizer(), documents, 300, (40, 100), (8, 20), seed=0)


def test_collections_of_any_seed_never_train_on_a_held_out_document(tmp_path):
    """Each collection holds out windows of the held-out documents only, so no collection's
    training windows share text with another collection's held-out ones; the old placements did."""
    rng = random.Random(0)
    for i in range(40):
        (tmp_path / f"doc{i}.txt").write_text("".join(chr(rng.randrange(33, 123)) for _ in range(300)))

    def spans(examples) -> set:  # the random text repeats no 12-gram, so a shared one is shared text
        return {
            tuple(ids[i : i + 12]) for e in examples for ids in [e.prompt_ids] for i in range(len(ids) - 11)
        }

    def shared_text(**placement) -> bool:
        train, val = set(), set()
        for seed in range(4):
            config = collect.CollectConfig(
                str(tmp_path / "out"), text_files=[str(tmp_path)], text_windows=20,
                context_tokens=(40, 100), future_tokens=(8, 20), val_fraction=0.2, seed=seed, **placement,
            )  # fmt: skip
            config.validate()
            split = data.split_examples(collect.build_examples(config, ByteTokenizer()), 0.2, seed)
            assert (len(split["train"]), len(split["val"])) == (16, 4)
            train |= spans(split["train"])
            val |= spans(split["val"])
        return bool(train & val)

    assert not shared_text()
    assert shared_text(held_out_documents=False)
    assert shared_text(held_out_documents=False, disjoint_windows=False)
    with pytest.raises(ValueError, match="held_out_documents needs disjoint_windows"):
        collect.CollectConfig("out", disjoint_windows=False).validate()
    with pytest.raises(ValueError, match="text-held-out windows: no text documents"):
        config = collect.CollectConfig(
            "out", text_files=[str(tmp_path)], text_windows=20, context_tokens=(40, 100), val_fraction=1e-6
        )
        collect.build_examples(config, ByteTokenizer())


def test_hf_dataset_offline_error(monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="network"):
        data.hf_dataset_texts("kvp-cache-test/does-not-exist")


# ---------------------------------------------------------------- reward


def brute_force_cost(ranking: list[int], importance: list[float]) -> float:
    c = [x / sum(importance) for x in importance]
    return sum(sum(c[ranking[i]] for i in range(b, len(ranking))) for b in range(len(ranking)))


def test_reward_oracle_reversed_and_brute_force():
    g = torch.Generator().manual_seed(0)
    importance = torch.rand(4, 30, generator=g) ** 4
    oracle = importance.argsort(-1, descending=True)
    assert torch.equal(reward.ranking_reward(oracle, importance), torch.full((4,), -1.0))
    assert (reward.ranking_reward(oracle.flip(-1), importance) < -1).all()
    for row in range(4):
        ranking = torch.randperm(30, generator=g)
        expected = brute_force_cost(ranking.tolist(), importance[row].tolist())
        assert reward.ranking_cost(ranking, importance[row]).item() == pytest.approx(expected, rel=1e-5)
        assert reward.ranking_reward(ranking, importance[row]).item() <= -1.0


def test_evicted_fraction_and_protection():
    importance = torch.tensor([[5.0, 1.0, 0.0, 3.0, 0.0, 1.0, 0.0, 0.0, 0.0, 10.0]])
    scores = torch.arange(10.0).flip(0)[None]  # keeps the earliest tokens
    curve = reward.evicted_fraction(scores, importance, [0.2, 0.5], protect=None)
    assert curve[:, 0].tolist() == pytest.approx([14 / 20, 11 / 20])  # kept {0,1}, then {0..4}
    # One sink and a one-token window: at budget 0.2 (2 kept) token 9 is forced in, then token 0.
    protected = reward.evicted_fraction(scores, importance, [0.2], protect=(1, 1))
    assert protected[0, 0].item() == pytest.approx(5 / 20)
    assert (reward.oracle_evicted_fraction(importance, [0.2, 0.5]) <= curve).all()


# ---------------------------------------------------------------- Plackett-Luce and RLOO


def brute_force_log_prob(scores: list[float], ranking: list[int]) -> float:
    remaining, total = list(ranking), 0.0
    for item in ranking:
        total += scores[item] - math.log(sum(math.exp(scores[j]) for j in remaining))
        remaining.remove(item)
    return total


def test_plackett_luce_log_prob_matches_loop_with_padding():
    scores = torch.tensor([[0.3, -1.2, 2.0, 0.5, 0.0], [1.0, 0.1, -0.4, 0.0, 0.0]])
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    ranking = torch.tensor([[2, 0, 4, 3, 1], [1, 2, 0, 3, 4]])
    steps = rl.plackett_luce_log_probs(scores, ranking, valid)
    assert steps.sum(-1)[0].item() == pytest.approx(brute_force_log_prob(scores[0].tolist(), [2, 0, 4, 3, 1]))
    assert steps.sum(-1)[1].item() == pytest.approx(brute_force_log_prob(scores[1, :3].tolist(), [1, 2, 0]))
    assert steps[1, 3:].abs().sum() == 0


def test_gumbel_sort_follows_plackett_luce():
    scores = torch.tensor([1.0, 0.0, -0.5])
    draws = 40_000
    rankings = rl.gumbel_sort(scores.expand(draws, 3), torch.Generator().manual_seed(0))
    for perm in itertools.permutations(range(3)):
        expected = math.exp(brute_force_log_prob(scores.tolist(), list(perm)))
        observed = (rankings == torch.tensor(perm)).all(-1).float().mean().item()
        assert observed == pytest.approx(expected, abs=4 * math.sqrt(expected * (1 - expected) / draws))


def test_rloo_advantages():
    rewards = torch.tensor([[-1.0, -3.0], [-2.0, -3.0], [-6.0, -4.0]])
    advantages = rl.rloo_advantages(rewards, clip=10.0)
    raw = rewards[:, 0] - torch.stack(
        [(rewards[[1, 2], 0]).mean(), rewards[[0, 2], 0].mean(), rewards[:2, 0].mean()]
    )
    expected = (raw - raw.mean()) / (raw.std() + 1e-8)
    torch.testing.assert_close(advantages[:, 0], expected)
    assert rl.rloo_advantages(rewards * 100, clip=1.0).abs().max() <= 1.0


# ---------------------------------------------------------------- fit and evaluate


def synthetic_traces(root, n_train=24, n_val=8, heads=2, tokens=48, dim=8):
    """Importance is a fixed function of the keys (and early positions): a learnable ranking."""
    g = torch.Generator().manual_seed(0)
    info = {"name": "tiny", "num_layers": 2, "num_kv_heads": heads, "head_dim": dim}
    for split, count in (("train", n_train), ("val", n_val)):
        per_layer, metas = [], []
        for _ in range(2):
            tensors = {"keys": [], "values": [], "importance": []}
            for _ in range(count):
                n = tokens - int(torch.randint(0, 8, (1,), generator=g))
                keys = torch.randn(heads, n, dim, generator=g)
                tensors["keys"].append(keys.half())
                tensors["values"].append(torch.randn(heads, n, dim, generator=g).half())
                tensors["importance"].append(torch.exp(3 * keys[..., 0]))
            per_layer.append(tensors)
        metas = [{"uid": f"s/{i}", "source": "synthetic", "prompt_tokens": tokens} for i in range(count)]
        write_shard(shard_dir(root, split, 0), per_layer, {"model": info, "methods": [], "samples": metas})


def test_fit_improves_validation_reward_and_resumes(tmp_path):
    synthetic_traces(tmp_path / "traces")
    config = fit.FitConfig(
        traces=str(tmp_path / "traces"),
        out=str(tmp_path / "run"),
        steps=60,
        batch_size=8,
        warmup=5,
        eval_every=20,
        lr=1e-2,
        hidden_dim=16,
        pos_dim=4,
        max_positions=64,
    )
    policy_dir = fit.fit(config)
    for layer in range(2):
        history = json.loads((tmp_path / "run" / "layers" / f"layer_{layer:02d}.json").read_text())
        assert history["best_val_reward"] > history["initial_val_reward"] + 0.05
    assert (tmp_path / "run" / "training_curves.png").stat().st_size > 1000
    policy = load_policy(policy_dir)
    assert policy.training_info["steps"] == 60 and policy.hidden_dim == 16
    assert policy.trained_length == 48  # the longest training prompt (synthetic_traces' tokens)
    stamp = (tmp_path / "run" / "layers" / "layer_00.safetensors").stat().st_mtime_ns
    fit.fit(config)  # every layer done: nothing retrains
    assert (tmp_path / "run" / "layers" / "layer_00.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("objective", ["regression", "ranknet", "listnet", "softsort"])
def test_supervised_objectives_learn(objective):
    from train.traces import LayerSample

    torch.manual_seed(0)
    keys, values = torch.randn(8, 2, 40, 8), torch.randn(8, 2, 40, 8)
    samples = [
        LayerSample(keys[i], values[i], torch.exp(3 * keys[i, ..., 0]), {}, f"s/{i}", "synthetic")
        for i in range(8)
    ]
    agents = HeadAgents(2, 8, 16, 4, 64, 2, "clamp")
    config = fit.FitConfig(
        "", "", objective=objective, steps=60, warmup=2, lr=1e-2, eval_every=10, ema_decay=0.9
    )
    before, _ = fit.validation_reward(agents, [pad_batch(samples)])
    history = fit.fit_layer(agents, samples, samples, config)
    assert history["best_val_reward"] > before


def test_anchor_mixes_the_start_ranking_into_the_target_and_holds_the_fit_near_it():
    from train.reward import normalized
    from train.traces import LayerSample

    torch.manual_seed(0)
    keys, values = torch.randn(8, 2, 40, 8), torch.randn(8, 2, 40, 8)
    # The new data asks for the reverse of what the start weights learn below.
    samples = [
        LayerSample(keys[i], values[i], torch.exp(-3 * keys[i, ..., 0]), {}, f"s/{i}", "synthetic")
        for i in range(8)
    ]
    start = HeadAgents(2, 8, 16, 4, 64, 2, "clamp")
    start_samples = [replace(s, importance=torch.exp(3 * s.keys[..., 0])) for s in samples]
    config = fit.FitConfig(
        "", "", objective="listnet", steps=40, warmup=2, lr=1e-2, eval_every=10, ema_decay=0.9
    )
    fit.fit_layer(start, start_samples, start_samples, config)
    start.requires_grad_(False)

    batch = pad_batch(samples)
    mixed = torch.stack([s.importance for s in fit.anchored(samples, start, 0.25)])
    valid = batch.valid[:, None, :].expand_as(batch.importance)
    expected = 0.75 * normalized(batch.importance, valid) + 0.25 * batch.scores(start).softmax(-1)
    assert torch.allclose(mixed, expected)
    assert torch.allclose(mixed.sum(-1), torch.ones(8, 2))

    def drift(weight):
        agents = copy.deepcopy(start).requires_grad_(True)
        fit.fit_layer(agents, fit.anchored(samples, start, weight), samples, config)
        with torch.no_grad():
            kept, moved = batch.scores(start).log_softmax(-1), batch.scores(agents).log_softmax(-1)
            return (kept.exp() * (kept - moved)).sum(-1).mean().item()  # KL(start || tuned)

    assert drift(0.9) < 0.5 * drift(0.0)
    with pytest.raises(ValueError, match="anchor must be in"):
        fit.FitConfig("", "", anchor=1.0, init_from="x").validate()
    with pytest.raises(ValueError, match="needs --init-from"):
        fit.FitConfig("", "", anchor=0.5).validate()


def test_a_run_dir_written_before_a_setting_existed_resumes_with_its_default(tmp_path):
    from accelerate import PartialState

    config = fit.FitConfig(traces="t", out=str(tmp_path / "run"), init_from="x")
    fit.prepare_run_dir(config, PartialState(cpu=True))
    settings = json.loads((tmp_path / "run" / "fit.json").read_text())
    del settings["anchor"]  # as written before --anchor existed
    (tmp_path / "run" / "fit.json").write_text(json.dumps(settings))
    fit.prepare_run_dir(config, PartialState(cpu=True))
    (tmp_path / "run" / "fit.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="other settings"):
        fit.prepare_run_dir(replace(config, anchor=0.5), PartialState(cpu=True))


def test_evaluate_writes_table_json_png(traces, tmp_path, llama):
    root, _ = traces
    policy = fit.new_policy(
        TraceSplit(root, "val").model, fit.FitConfig("", "", hidden_dim=8, max_positions=32)
    )
    policy.save_pretrained(tmp_path / "policy")
    args = [
        "--traces", str(root), "--policy", str(tmp_path / "policy"), "--out", str(tmp_path / "report"),
        "--position-strategies", "clamp", "scale", "--budgets", "0.25", "0.5",
    ]  # fmt: skip
    from train.__main__ import main

    main(["evaluate", *args])
    result = json.loads((tmp_path / "report" / "eviction_cost_val.json").read_text())
    methods = result["methods"]
    assert {"kvp", "kvp[scale]", "oracle", "knorm", "tova", "snapkv", "h2o", "expected_attention"} <= set(
        methods
    )
    assert methods["oracle"]["auc"] == pytest.approx(1.0)
    assert all(m["auc"] >= 1.0 - 1e-6 for m in methods.values())
    assert all(len(m["cost"]) == 2 for m in methods.values())
    assert "| kvp |" in (tmp_path / "report" / "eviction_cost_val.md").read_text()
    assert (tmp_path / "report" / "eviction_cost_val.png").stat().st_size > 1000
    card = evaluate.card_evaluation(result)
    assert card["budgets"] == [0.25, 0.5] and "kvp" in card["methods"]
    from kvp_cache.provenance import sha256_of

    assert next(iter(result)) == "provenance"
    assert result["provenance"]["policy"]["sha256"] == sha256_of(tmp_path / "policy" / "model.safetensors")
    assert result["policies"]["kvp[scale]"]["sha256"] == result["provenance"]["policy"]["sha256"]


# ---------------------------------------------------------------- targets, RL variants, scale-out


def test_targets_by_name():
    from train import targets
    from train.traces import LayerSample

    importance = torch.arange(1.0, 41.0).expand(2, 40)
    sample = LayerSample(torch.zeros(2, 40, 8), torch.zeros(2, 40, 8), importance, {}, "s/0", "s")
    assert torch.equal(targets.target("attention", sample), importance)
    evictable = targets.target("attention_evictable", sample, sinks=4, window=16)
    assert evictable[:, :4].abs().sum() == 0 and evictable[:, 24:].abs().sum() == 0
    assert torch.equal(evictable[:, 4:24], importance[:, 4:24])
    with pytest.raises(ValueError, match="value_importance"):
        targets.target("value_attention", sample)
    valued = LayerSample(
        sample.keys, sample.values, importance, {}, "s/0", "s", value_importance=2 * importance
    )
    value_evictable = targets.target("value_attention_evictable", valued, sinks=4, window=16)
    assert torch.equal(value_evictable, 2 * evictable)
    with pytest.raises(ValueError, match="target must be one of"):
        targets.target("loss", sample)
    with pytest.raises(ValueError, match="target must be one of"):
        fit.FitConfig("", "", target="loss").validate()


def test_rloo_over_permutations_of_one_trace():
    rewards = torch.tensor([[[-1.0], [-5.0]], [[-2.0], [-7.0]], [[-4.0], [-6.0]]])  # [k=3, traces=2, heads=1]
    advantages = rl.rloo_advantages(rewards, clip=10.0)
    raw = (
        rewards - (rewards.sum(0, keepdim=True) - rewards) / 2
    )  # baseline: the other permutations of that trace
    expected = (raw - raw.mean()) / (raw.std() + 1e-8)
    torch.testing.assert_close(advantages, expected)
    # the traces' very different reward levels do not leak into the advantages
    torch.testing.assert_close(rl.rloo_advantages(rewards + torch.tensor([[[0.0], [9.0]]]), 10.0), advantages)


def test_rl_with_permutations_learns():
    torch.manual_seed(0)
    keys = torch.randn(6, 2, 40, 8)
    values = torch.randn(6, 2, 40, 8)
    from train.traces import LayerSample

    samples = [
        LayerSample(keys[i], values[i], torch.exp(3 * keys[i, ..., 0]), {}, f"s/{i}", "s") for i in range(6)
    ]
    agents = HeadAgents(2, 8, 16, 4, 64, 2, "clamp")
    config = fit.FitConfig("", "", objective="rl", permutations=4, batch_size=4, steps=60, warmup=2, lr=1e-2)
    config.validate()
    history = fit.fit_layer(agents, samples, samples, config)
    assert history["best_val_reward"] > history["initial_val_reward"] + 0.05
    assert len(history["train_reward"]) == 60


def fit_config(root, out, **overrides):
    settings = dict(
        steps=30, batch_size=8, warmup=3, eval_every=10, lr=1e-2, hidden_dim=16, pos_dim=4, max_positions=64
    )
    return fit.FitConfig(traces=str(root), out=str(out), **{**settings, **overrides})


def test_rl_fine_tunes_from_listnet_weights(tmp_path):
    synthetic_traces(tmp_path / "traces")
    listnet_dir = fit.fit(fit_config(tmp_path / "traces", tmp_path / "listnet", objective="listnet"))
    config = json.loads((listnet_dir / "config.json").read_text())
    (listnet_dir / "config.json").write_text(json.dumps({**config, "trained_length": 500}))
    rl_dir = fit.fit(
        fit_config(tmp_path / "traces", tmp_path / "rl", objective="rl", init_from=str(listnet_dir))
    )
    tuned_policy = load_policy(rl_dir)
    assert tuned_policy.trained_length == 500  # rows the start weights reached stay trained
    start_sha = load_policy(listnet_dir).weights_sha256
    assert tuned_policy.training_info["init_from"] == f"{listnet_dir} (sha256 {start_sha})"
    for layer in range(2):
        listnet = json.loads((tmp_path / "listnet" / "layers" / f"layer_{layer:02d}.json").read_text())
        tuned = json.loads((tmp_path / "rl" / "layers" / f"layer_{layer:02d}.json").read_text())
        assert tuned["initial_val_reward"] == pytest.approx(listnet["best_val_reward"], abs=1e-5)
        assert tuned["best_val_reward"] >= tuned["initial_val_reward"]
    with pytest.raises(ValueError, match="another architecture"):
        fit.fit(fit_config(tmp_path / "traces", tmp_path / "wide", hidden_dim=32, init_from=str(listnet_dir)))


def test_fit_split_across_two_processes_matches_one(tmp_path):
    """accelerate launch with 2 CPU processes (gloo): each trains one layer; same policy as one process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    synthetic_traces(tmp_path / "traces")
    single = fit.fit(fit_config(tmp_path / "traces", tmp_path / "single", objective="listnet"))
    repo = Path(__file__).resolve().parents[1]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += [
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
    ]
    args = ["--traces", str(tmp_path / "traces"), "--out", str(tmp_path / "double"), "--objective", "listnet"]
    for name, value in dict(
        steps=30, batch_size=8, warmup=3, eval_every=10, hidden_dim=16, pos_dim=4
    ).items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    args += ["--lr", "1e-2", "--max-positions", "64", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(repo), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [*launch, "-m", "train", "fit", *args], cwd=repo, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    trained_by = [
        json.loads((tmp_path / "double" / "layers" / f"layer_{i:02d}.json").read_text()) for i in (0, 1)
    ]
    assert [record["process"] for record in trained_by] == [0, 1]
    expected = load_file(str(single / "model.safetensors"))
    actual = load_file(str(tmp_path / "double" / "policy" / "model.safetensors"))
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=1e-5, rtol=1e-4)


def test_reproduce_configs_are_the_shipped_recipe(tmp_path):
    from train import reproduce

    main, native = reproduce.collect_configs(tmp_path)
    for config in (main, native):
        config.validate()
        assert (config.task_future, config.only_correct, config.ruler_split) == ("gold", True, "train")
        assert config.context_tokens == (512, 4096) and config.future_tokens == (64, 256)
    assert main.synthetic + main.synthetic_after + sum(main.windows.values()) == 460
    assert native.windows == {"native_code": 110} and native.seed != main.seed
    splits = {main.train_name, main.val_name, native.train_name, native.val_name}
    assert len(splits) == 4  # the second collection never resumes into the first one's shards
    fit_config = reproduce.fit_config(tmp_path, tmp_path / "fit")
    fit_config.validate()
    assert (fit_config.objective, fit_config.target) == ("listnet", "attention_evictable")
    assert (fit_config.position_strategy, fit_config.max_positions) == ("scale", 128)
    first_fit = REPO / "docs/smollm2/ablation_513_traces/steps400_policy"  # where the fine-tune starts
    assert_fit_made_the_shipped_policy(fit_config, str(first_fit))
    assert fit_config.train_split.split("+") == [main.train_name, native.train_name]
    assert fit_config.val_split.split("+") == [main.val_name, native.val_name]

    # The fine-tune: the collections and the anchored fit docs/decode/training_runs.json records.
    recorded = ("collection_train", "collection_train_decode", "collection_train_long", "fit-anchor08long")
    tune = assert_finetune_is_recorded(
        tmp_path, "smollm2", first_fit, "docs/decode/training_runs.json", recorded
    )
    assert tune.layers is None  # every layer: the fit ran before `layers` was a setting

    assert reproduce.RECIPES["smollm2"].calibrated
    shipped_calibration = load_policy("smollm2-135m-instruct").calibration.record
    assert shipped_calibration["variant"] == reproduce.CALIBRATION_VARIANT
    assert shipped_calibration["loss"] == reproduce.CalibrateConfig().loss
    with pytest.raises(ValueError, match="windows: unknown corpus"):
        collect.CollectConfig(str(tmp_path), windows={"stdlib": 3}).validate()

    # Gemma's recipe: plain prompts of its own model, traced up to 8K, the paper's target.
    (gemma,) = reproduce.collect_configs(tmp_path, "gemma3-270m")
    assert gemma.model == "gemma3-270m" and gemma.context_tokens == (512, 8192)
    assert not (gemma.disjoint_windows or gemma.held_out_documents)
    assert gemma.synthetic + gemma.synthetic_after + sum(gemma.windows.values()) == 140
    gemma_fit = reproduce.fit_config(tmp_path, tmp_path / "fit", model="gemma3-270m")
    gemma_fit.validate()
    assert gemma_fit.train_split == "train"
    gemma_first_fit = REPO / "docs/gemma3/first_fit_policy"
    assert_fit_made_the_shipped_policy(gemma_fit, str(gemma_first_fit))
    # Its fine-tune: docs/decode/gemma3/training_runs.json's records of the shipped a03LE.
    recorded = ("collect-train_decode-s11", "collect-train_long-s11", "collect-train_essays-s11", "fit-a03LE")
    assert_finetune_is_recorded(
        tmp_path, "gemma3-270m", gemma_first_fit, "docs/decode/gemma3/training_runs.json", recorded
    )
    assert not reproduce.RECIPES["gemma3-270m"].calibrated
    assert load_policy("gemma3-270m").calibration is None


def test_ship_copies_the_calibration_and_drops_a_stale_one(tmp_path, monkeypatch):
    from train import reproduce

    source, target = tmp_path / "policy", tmp_path / "policies"
    source.mkdir()
    for name in ("config.json", "model.safetensors", "README.md", "calibration.safetensors"):
        (source / name).write_text(name)
    monkeypatch.setattr(reproduce, "POLICIES_DIR", target)
    reproduce.ship(source, "smollm2")
    shipped = target / "smollm2-135m-instruct"
    assert (shipped / "calibration.safetensors").read_text() == "calibration.safetensors"
    (source / "calibration.safetensors").unlink()
    reproduce.ship(source, "smollm2")
    assert sorted(p.name for p in shipped.iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_reproduce_runs_the_fine_tune_on_the_first_fit_then_calibrates_and_ships_it(tmp_path, monkeypatch):
    """The steps' order and hand-offs, each step replaced by a recorder."""
    import argparse

    from train import reproduce

    calls = []

    def fit(config):
        calls.append(("fit", config.init_from, config.anchor))
        Path(config.out, "policy").mkdir(parents=True)
        Path(config.out, "training_curves.png").write_text("")
        return Path(config.out, "policy")

    def step(name, field):
        return lambda config: calls.append((name, getattr(config, field)))

    monkeypatch.setattr(reproduce, "collect", step("collect", "train_name"))
    monkeypatch.setattr(reproduce, "collect_decode", step("collect_decode", "train_name"))
    monkeypatch.setattr(reproduce, "fit", fit)
    monkeypatch.setattr(reproduce, "run_evaluation", lambda c: calls.append(("evaluate", c.split, c.policy)))
    monkeypatch.setattr(reproduce, "run_downstream", step("downstream", "split"))
    monkeypatch.setattr(reproduce, "calibrate", step("calibrate", "policy"))
    monkeypatch.setattr(reproduce, "ship", lambda policy_dir, model: calls.append(("ship", policy_dir)))
    run = tmp_path / "run"
    args = argparse.Namespace(
        model="smollm2", run_dir=str(run), report_dir=str(tmp_path / "report"), essays_dir="essays",
        objective="listnet", ship=True,
    )  # fmt: skip
    reproduce.reproduce_command(args)
    base, tuned = run / "fit/policy", run / "finetune/policy"
    assert calls == [
        ("collect", "train"),
        ("collect", "train_native"),
        ("fit", None, 0.0),
        ("evaluate", "val+val_native", [str(base)]),
        ("downstream", "val"),
        ("downstream", "val_native"),
        ("collect", "train"),
        ("collect_decode", "train_decode"),
        ("collect", "train_long"),
        ("fit", str(base), 0.8),
        ("evaluate", "val+val_long", [str(tuned)]),
        ("calibrate", str(tuned)),
        ("ship", run / "calibrate/policy-tau_w"),
    ]


def assert_finetune_is_recorded(tmp_path, model: str, first_fit: Path, runs_file: str, recorded: tuple):
    """The recipe's fine-tune of ``model`` is what ``runs_file`` records: each collection's settings
    (``recorded[:-1]``, the essays named as the records write them) and the fit's (``recorded[-1]``),
    started from ``first_fit``; the shipped policy records that start and these fit settings."""
    from train import reproduce

    runs = json.loads((REPO / runs_file).read_text())
    collections = reproduce.finetune_collect_configs(tmp_path / "tune", model, "<pg_essays>")
    for config, name in zip(collections, recorded[:-1], strict=True):
        config.validate()
        settings = json.loads(json.dumps(asdict(config)))
        assert settings.pop("out") == str(tmp_path / "tune")
        assert settings == runs[name]["settings"]
    tune = reproduce.finetune_fit_config(tmp_path / "tune", tmp_path / "ft", first_fit, model)
    tune.validate()
    where = {"traces": None, "out": None, "init_from": None}  # paths of the run that made it
    tuned, recorded_fit = asdict(tune) | where, runs[recorded[-1]]["fit_settings"] | where
    assert {k: tuned[k] for k in recorded_fit} == recorded_fit
    shipped = reproduce.RECIPES[model].shipped_name
    start_sha = load_policy(str(first_fit)).weights_sha256
    assert load_policy(shipped).training_info["init_from"].endswith(f"(sha256 {start_sha})")
    assert_fit_made_the_shipped_policy(tune, shipped)
    return tune


def assert_fit_made_the_shipped_policy(fit_config, shipped_name: str) -> None:
    """The recipe's fit settings are those the shipped policy (or a policy directory) records it was
    trained with."""
    policy = load_policy(shipped_name)
    trained = policy.training_info
    assert (fit_config.objective, fit_config.target) == (trained["objective"], trained["target"])
    assert (fit_config.steps, fit_config.batch_size, fit_config.lr) == (
        trained["steps"],
        trained["batch_size"],
        trained["lr"],
    )
    assert (fit_config.hidden_dim, fit_config.position_strategy, fit_config.max_positions) == (
        policy.hidden_dim,
        policy.position_strategy,
        policy.max_positions,
    )


# ---------------------------------------------------------------- downstream validation


def test_downstream_scores_held_out_examples_against_a_direct_cache(tmp_path, prose_dir):
    """The held-out examples are exactly the traced ones; each NLL equals a cache built and fed directly."""
    from conftest import TINY_CONFIGS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvp_cache import KVPCache
    from kvp_cache.integrations import cache_kwarg
    from kvp_cache.models import MODELS
    from train import downstream

    torch.manual_seed(0)
    config = TINY_CONFIGS["llama"]()
    config.vocab_size = 49152
    model = AutoModelForCausalLM.from_config(config).eval()
    tokenizer = AutoTokenizer.from_pretrained(MODELS["smollm2"].converted_dir())
    collect_config = collect.CollectConfig(
        str(tmp_path / "traces"), model="tiny", text_files=[str(prose_dir)], text_windows=6,
        context_tokens=(48, 64), future_tokens=(5, 8), val_fraction=0.5, shard_size=2,
    )  # fmt: skip
    collect.collect(collect_config, model=model, tokenizer=tokenizer)
    examples = downstream.held_out_examples(tmp_path / "traces", "val", tokenizer)
    train_uids = {s["uid"] for s in TraceSplit(tmp_path / "traces", "train").samples}
    assert [e.uid for e in examples] == [s["uid"] for s in TraceSplit(tmp_path / "traces", "val").samples]
    assert len(examples) == 3 and not train_uids & {e.uid for e in examples}

    run = downstream.DownstreamConfig(
        str(tmp_path / "traces"),
        str(tmp_path / "out"),
        methods=["streaming_llm", "knorm"],
        budgets=[0.25, 1.0],
    )
    result = downstream.run_downstream(run, model=model, tokenizer=tokenizer)
    records = [
        json.loads(line) for line in (tmp_path / "out" / "downstream_val.jsonl").read_text().splitlines()
    ]
    for record, example in zip(records, examples, strict=True):
        for method in ("streaming_llm", "knorm"):
            assert record["nll"][f"{method}@1"] == pytest.approx(record["nll"]["full"], abs=1e-4)
            cache = KVPCache(model, method=method, budget=0.25)
            ids = torch.tensor([example.prompt_ids + example.future_ids])
            with torch.no_grad():
                first = model(ids[:, : len(example.prompt_ids)], **{cache_kwarg(model): cache}).logits[:, -1:]
                rest = model(ids[:, len(example.prompt_ids) : -1], **{cache_kwarg(model): cache}).logits
            logits = torch.cat([first, rest], 1)[0]
            expected = torch.nn.functional.cross_entropy(logits, torch.tensor(example.future_ids))
            assert record["nll"][f"{method}@0.25"] == pytest.approx(expected.item(), abs=1e-4)
    assert next(iter(result)) == "provenance"
    rows = {(r["source"], r["method"], r["budget"]) for r in result["rows"]}
    assert ("text", "knorm", 0.25) in rows and ("all text", "streaming_llm", 1.0) in rows
    downstream.run_downstream(run, model=model, tokenizer=tokenizer)  # resumes: nothing recomputed
    assert len((tmp_path / "out" / "downstream_val.jsonl").read_text().splitlines()) == 3

    # Another method later: only it is scored, and each record keeps the logged scores.
    run.methods = ["streaming_llm", "knorm", "random"]
    result = downstream.run_downstream(run, model=model, tokenizer=tokenizer)
    lines = (tmp_path / "out" / "downstream_val.jsonl").read_text().splitlines()
    assert len(lines) == 6
    for before, after in zip(records, map(json.loads, lines[3:]), strict=True):
        assert after["uid"] == before["uid"] and set(after["nll"]) == set(before["nll"]) | {
            "random@0.25",
            "random@1",
        }
        assert {k: after["nll"][k] for k in before["nll"]} == pytest.approx(before["nll"], abs=1e-4)
        assert after["nll"]["random@1"] == pytest.approx(after["nll"]["full"], abs=1e-4)
    assert ("all text", "random", 0.25) in {(r["source"], r["method"], r["budget"]) for r in result["rows"]}

    # A policy whose weights changed under the same name is scored again; the rest is kept.
    def policy_scores(seed: int) -> list[dict]:
        torch.manual_seed(seed)
        KVPolicy.for_model(model, hidden_dim=8, pos_dim=4, max_positions=16).save_pretrained(tmp_path / "p")
        run.policy = [f"mine={tmp_path / 'p'}"]
        downstream.run_downstream(run, model=model, tokenizer=tokenizer)
        return [
            json.loads(line) for line in (tmp_path / "out" / "downstream_val.jsonl").read_text().splitlines()
        ]

    # Other sinks: every score is new.
    run.sinks = 2
    downstream.run_downstream(run, model=model, tokenizer=tokenizer)
    lines = (tmp_path / "out" / "downstream_val.jsonl").read_text().splitlines()
    assert len(lines) == 9 and json.loads(lines[-1])["kept"]["sinks"] == 2
    run.sinks = 4
    first = policy_scores(0)
    assert len(first) == 12 and len(policy_scores(0)) == 12  # the same weights: nothing rescored
    second = policy_scores(1)
    assert len(second) == 15
    for a, b in zip(first[-3:], second[-3:], strict=True):
        assert a["policies"]["mine"] != b["policies"]["mine"]
        assert a["nll"]["knorm@0.25"] == b["nll"]["knorm@0.25"]
    run.budgets = [0.25]  # new weights scored at one budget: the old weights' other budget is dropped
    third = policy_scores(2)[-3:]
    assert all("mine@0.25" in r["nll"] and "mine@1" not in r["nll"] and "knorm@1" in r["nll"] for r in third)


def test_downstream_pairs_every_method_with_the_first_on_the_same_examples():
    from train import downstream

    # b is always 0.1 worse than a, while the examples themselves spread by 0..9.
    records = [
        {"source": "code", "nll": {"full": 1.0, "a@0.1": 1.0 + i, "b@0.1": 1.1 + i}} for i in range(10)
    ]
    paired = downstream.paired_rows(records, ["a", "b"], [0.1])
    assert [(r["source"], r["method"], r["against"]) for r in paired] == [
        (downstream.ALL_TEXT, "b", "a"),
        ("code", "b", "a"),
    ]
    assert paired[1]["nll_difference"] == pytest.approx(0.1)
    assert paired[1]["ci95"] == pytest.approx([0.1, 0.1])
    unpaired = {r["method"]: r["ci95"] for r in downstream.summary_rows(records, ["a", "b"], [0.1])}
    assert unpaired["a"][1] > unpaired["b"][0]  # apart, the two intervals overlap widely
    table = downstream.markdown_paired(paired, [0.1])
    assert "against `a`" in table and "| code | +0.1000 (+0.1000, +0.1000) |" in table


def test_downstream_pools_every_text_corpus_and_no_task():
    from train import downstream
    from train.corpora import CORPORA

    sources = [*CORPORA, "text", "niah_single", "niah_single-after"]
    records = [{"source": s, "nll": {"full": 1.0, "kvp@0.1": 1.0 + i}} for i, s in enumerate(sources)]
    rows = {r["source"]: r for r in downstream.summary_rows(records, ["kvp"], [0.1])}
    assert rows[downstream.ALL_TEXT]["n"] == len(CORPORA) + 1  # native_code included, needles not
    assert rows[downstream.ALL_TEXT]["nll_increase"] == pytest.approx(
        sum(range(len(CORPORA) + 1)) / (len(CORPORA) + 1)
    )


def test_downstream_tops_up_only_the_example_it_scored(tmp_path):
    """A log record is topped up only for the example it was scored on: by its digest, or for records
    made before digests, by the full cache's NLL, which every run scores again."""
    from train.downstream import FULL, score_examples

    example = data.Example("code/0", "code", [1, 2, 3], [4, 5])
    log = tmp_path / "log.jsonl"
    kept = {"sinks": 4, "window": 16}
    legacy = {
        "uid": "code/0",
        "source": "code",
        "nll": {FULL: 1.0, "a@0.1": 1.5},
        "policies": {},
        "kept": kept,
    }
    log.write_text(json.dumps(legacy) + "\n")
    calls = []

    def score(full: float):
        def run(example, missing):
            calls.append(sorted(missing))
            return {FULL: full, **{f"{name}@0.1": 2.0 for name in missing}}

        return run

    scorers = {"a": "a", "b": "b"}
    with pytest.raises(ValueError, match="full cache's NLL is 1.2000 where .* recorded 1.0000"):
        score_examples(log, [example], {}, kept, scorers, [0.1], score(1.2), "test")
    (record,) = score_examples(log, [example], {}, kept, scorers, [0.1], score(1.0), "test")
    assert record["nll"] == {FULL: 1.0, "a@0.1": 1.5, "b@0.1": 2.0} and calls[-1] == ["b"]
    assert record["ids_sha256"] == data.ids_digest([1, 2, 3, 4, 5])
    calls.clear()
    other = data.Example("code/0", "code", [1, 2, 3], [4, 6])
    with pytest.raises(ValueError, match="scored another code/0 than the one rebuilt now"):
        score_examples(log, [other], {}, kept, {**scorers, "c": "c"}, [0.1], score(1.0), "test")
    assert calls == []  # refused before any work
