"""Decode-time training data (issue 29): collection against brute-force attention and its resume,
scoring every token as it entered the cache, the fit on decode traces, and the decode-time
downstream measurement against a hand loop. Tiny random models and synthetic traces only."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvp_cache import KVPCache
from kvp_cache.compat import cache_kwarg
from kvp_cache.policy import HeadAgents, KVPolicy, load_policy
from kvp_cache.targets import eviction_points
from train import data, decode_downstream, fit, supervised
from train.batch import one_row_positions, pad_batch
from train.decode import DecodeCollectConfig, decode_examples, stored_evictions, write_decode_traces
from train.decode_downstream import DecodeDownstreamConfig, sequence_nll
from train.downstream import ALL_TEXT, FULL, source_groups
from train.traces import LayerSample, TraceSplit

PROMPT, DECODE = 24, 40


def decode_config(tmp_path, **overrides) -> DecodeCollectConfig:
    settings = dict(
        out=str(tmp_path), windows={"code": 1}, prompt_tokens=PROMPT, decode_tokens=DECODE, chunk_tokens=1,
        cap=12, evict_every=4, sinks=2, window=3, max_evictions=4, shard_size=2,
    )  # fmt: skip
    return DecodeCollectConfig(**{**settings, **overrides})


def random_sequences(count: int, seed: int, sampled: bool = False) -> list[data.Example]:
    g = torch.Generator().manual_seed(seed)
    return [
        data.Example(
            f"rand/{i}",
            "rand",
            torch.randint(0, 256, (PROMPT,), generator=g).tolist(),
            None if sampled and i == 0 else torch.randint(0, 256, (DECODE,), generator=g).tolist(),
        )
        for i in range(count)
    ]


def brute_force_target(attention, start, end, sinks, window):
    """``[kv_heads, start]``: over queries ``start .. end - 1``, the max over each GQA group of the
    attention to each token read, summed; sinks and the last ``window`` read zeroed."""
    heads, group = 2, attention.shape[0] // 2
    rows = attention[:, start:end, :start].reshape(heads, group, end - start, start)
    target = rows.amax(dim=1).sum(dim=1)
    target[:, :sinks] = 0
    target[:, start - window :] = 0
    return target


def test_collection_matches_brute_force_attention_and_resumes(tmp_path, llama):
    config = decode_config(tmp_path)
    splits = {"train": random_sequences(3, 0, sampled=True), "val": random_sequences(1, 1)}
    write_decode_traces(llama, tmp_path, splits, config)
    train = TraceSplit(tmp_path, "train")
    forwards = config.forwards()
    # An eviction after the last token has no query to define its target: not stored.
    schedule = [t for t in eviction_points(forwards, config.cap, config.evict_every) if t < PROMPT + DECODE]
    kept = stored_evictions(schedule, config.max_evictions)
    assert len(schedule) > len(kept) == 4 and kept[0] == schedule[0] and kept[-1] == schedule[-1]
    sampled = train.samples[0]
    assert len(sampled["continuation_ids"]) == DECODE and sampled["source"] == "rand"
    for index, info in enumerate(train.samples):
        assert info["evictions"] == kept and sum(info["forward_tokens"]) == kept[-1]
        continuation = info.get("continuation_ids") or splits["train"][index].future_ids
        ids = splits["train"][index].prompt_ids + continuation
        with torch.no_grad():
            out = llama(torch.tensor([ids]), output_attentions=True, use_cache=True)
        for layer, attention in enumerate(out.attentions):
            stored = train.layer(layer)[index]
            assert stored.keys.shape == (2, kept[-1], 16) and stored.importance.shape == (4, 2, kept[-1])
            torch.testing.assert_close(
                stored.keys.float(),
                out.past_key_values.layers[layer].keys[0, :, : kept[-1]],
                atol=2e-3,
                rtol=2e-3,
            )
            for k, start in enumerate(kept):
                # Each stored eviction's span ends at the next eviction of the FULL schedule.
                end = ([*schedule[1:], len(ids)])[schedule.index(start)]
                expected = brute_force_target(attention[0], start, end, config.sinks, config.window)
                torch.testing.assert_close(stored.importance[k, :, :start], expected, atol=2e-3, rtol=2e-3)
                assert stored.importance[k, :, start:].abs().sum() == 0
    # Resume: finished shards are kept, a shard without meta.json is traced again, identically.
    shards = sorted((tmp_path / "train").glob("shard_*"))
    stamps = [(s / "meta.json").stat().st_mtime_ns for s in shards]
    before = train.layer(0)[2].importance.clone()
    (shards[1] / "meta.json").unlink()
    write_decode_traces(llama, tmp_path, splits, config)
    assert (shards[0] / "meta.json").stat().st_mtime_ns == stamps[0]
    assert (shards[1] / "meta.json").exists()
    torch.testing.assert_close(TraceSplit(tmp_path, "train").layer(0)[2].importance, before)
    with pytest.raises(ValueError, match="other settings"):
        write_decode_traces(llama, tmp_path, splits, decode_config(tmp_path, cap=16))


def test_batch_scores_every_token_as_it_entered_the_cache():
    torch.manual_seed(0)
    agents = HeadAgents(2, 8, 16, 4, 16, 2, "scale", trained_length=16)
    prompt, chunks = 10, [3, 3] + [1] * 6  # decoded one-token rows on both sides of the table's end (15)
    n = prompt + sum(chunks)
    keys, values = torch.randn(2, n, 8), torch.randn(2, n, 8)
    importance = torch.rand(2, 2, n)
    importance[0, :, 13:] = 0
    decoded = LayerSample(
        keys, values, importance, {}, "d/0", "d", evictions=[13, n], forward_tokens=[prompt, *chunks]
    )
    prefilled = LayerSample(keys[:, :9], values[:, :9], torch.rand(2, 9), {}, "p/0", "p")
    batch = pad_batch([prefilled, decoded])
    assert batch.importance.shape == (3, 2, n) and batch.valid.sum(-1).tolist() == [9, 13, n]
    one_token = next(positions for _, positions in batch.entries if positions.shape == (6, 1))
    assert one_row_positions(agents, one_token) is not None  # scored as one wide row
    scores = batch.scores(agents)
    with torch.no_grad():
        # The cache scores a forward's tokens as one row, at their indices in the sequence.
        expected = [agents(keys[None, :, :prompt], values[None, :, :prompt], torch.arange(prompt)[None])[0]]
        start = prompt
        for length in chunks:
            span = slice(start, start + length)
            expected.append(
                agents(keys[None, :, span], values[None, :, span], torch.arange(start, start + length)[None])[
                    0
                ]
            )
            start += length
        expected = torch.cat(expected, dim=-1)
        prefill_scores = agents(keys[None, :, :9], values[None, :, :9], torch.arange(9)[None])[0]
    torch.testing.assert_close(scores[2].detach(), expected)
    torch.testing.assert_close(scores[1, :, :13].detach(), expected[:, :13])
    assert torch.isinf(scores[1, :, 13:]).all() and torch.isinf(scores[0, :, 9:]).all()
    torch.testing.assert_close(scores[0, :, :9].detach(), prefill_scores)
    # Not the prefill reading: the same tokens as one row score differently under "scale".
    assert not torch.allclose(expected, agents(keys[None], values[None], torch.arange(n)[None])[0].detach())


def toy_decode_samples(count: int, seed: int) -> list[LayerSample]:
    """Sequences whose tokens matter by their first key dimension, ranked at three evictions."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        keys, values = torch.randn(2, 48, 8, generator=g), torch.randn(2, 48, 8, generator=g)
        evictions = [32, 40, 48]
        importance = torch.exp(3 * keys[..., 0]).expand(3, -1, -1).clone()
        for k, read in enumerate(evictions):
            importance[k, :, read:] = 0
        samples.append(
            LayerSample(
                keys,
                values,
                importance,
                {},
                f"d/{i}",
                "d",
                evictions=evictions,
                forward_tokens=[32] + [1] * 16,
            )
        )
    return samples


def listnet_loss(agents: HeadAgents, samples: list[LayerSample]) -> float:
    with torch.no_grad():
        loss, _ = supervised.supervised_objective(supervised.listnet, agents, pad_batch(samples), None)
    return loss.item()


@pytest.mark.parametrize("objective", ["listnet", "rl"])
def test_fit_on_decode_traces_reduces_its_loss(objective):
    torch.manual_seed(0)
    train, val = toy_decode_samples(12, 0), toy_decode_samples(4, 1)
    agents = HeadAgents(2, 8, 16, 4, 64, 2, "scale")
    config = fit.FitConfig(
        "", "", objective=objective, steps=60, warmup=2, lr=1e-2, eval_every=10, batch_size=4
    )
    config.validate()
    before = listnet_loss(agents, val)
    history = fit.fit_layer(agents, train, val, config)
    assert history["best_val_reward"] > history["initial_val_reward"] + 0.05
    assert listnet_loss(agents, val) < before - 0.05


def test_fit_mixes_prefill_and_decode_traces(tmp_path, llama):
    """A trace root holding prefill and decode splits trains on both at once (``train+train_decode``)."""
    from train import collect

    prefill_examples = [
        data.Example(e.uid, e.source, e.prompt_ids, e.future_ids[:6]) for e in random_sequences(4, 2)
    ]
    collect.write_traces(
        llama, tmp_path, {"train": prefill_examples[:3], "val": prefill_examples[3:]}, set(), 2, 4, {"t": 1}
    )
    config = decode_config(tmp_path, train_name="train_decode", val_name="val_decode")
    write_decode_traces(
        llama,
        tmp_path,
        {"train_decode": random_sequences(3, 0), "val_decode": random_sequences(1, 1)},
        config,
    )
    both = TraceSplit(tmp_path, "train+train_decode")
    assert [s.evictions is None for s in both.layer(0)] == [True] * 3 + [False] * 3
    run = fit.FitConfig(
        str(tmp_path), str(tmp_path / "run"), objective="listnet", target="attention_evictable", steps=4, warmup=1,
        eval_every=2, hidden_dim=8, pos_dim=4, max_positions=16, position_strategy="scale",
        train_split="train+train_decode", val_split="val+val_decode",
    )  # fmt: skip
    policy_dir = fit.fit(run)
    assert (policy_dir / "model.safetensors").exists()
    record = json.loads((policy_dir / "config.json").read_text())["training"]
    assert "3 rand" not in record["data"] and "6 rand" in record["data"]
    with pytest.raises(ValueError, match="decode trace"):
        fit.layer_samples(both, 0, fit.FitConfig("", "", target="value_attention"))


def hand_nll(model, ids: list[int], prompt: int, chunk: int, cache) -> float:
    """The continuation's mean NLL, the prompt read in one forward, then ``chunk`` tokens at a time."""
    keyword = cache_kwarg(model)
    logits = [model(torch.tensor([ids[:prompt]]), **{keyword: cache}).logits[0, -1:]]
    for start in range(prompt, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)
        logits.append(model(torch.tensor([ids[start:end]]), **{keyword: cache}).logits[0])
    return F.cross_entropy(torch.cat(logits).float(), torch.tensor(ids[prompt:])).item()


@torch.no_grad()
def test_decode_downstream_equals_a_hand_loop(llama):
    example = random_sequences(1, 3)[0]
    ids = example.prompt_ids + example.future_ids
    policy = KVPolicy.for_model(
        llama, hidden_dim=8, pos_dim=4, max_positions=16, num_mlp_layers=2, position_strategy="scale"
    )
    config = DecodeDownstreamConfig(
        "", "", methods=["knorm"], caps=[10, 16], chunk_tokens=4, evict_every=3, sinks=2, window=3
    )
    config.validate()
    rankings = {"kvp": {}, "kvp_rescore": {"rescore": True}, "kvp_aged": {"age_decay": 1.0}}
    methods = {name: {"policy": policy, **ranking} for name, ranking in rankings.items()}
    nll = sequence_nll(llama, example, methods | {"knorm": {"method": "knorm"}}, config)
    assert nll[FULL] == pytest.approx(hand_nll(llama, ids, PROMPT, 4, DynamicCache()), abs=1e-4)
    options = dict(budget=1.0, sink_tokens=2, window_tokens=3, evict_every=3)
    for cap in config.caps:
        for name, chosen in (*methods.items(), ("knorm", {"method": "knorm"})):
            cache = KVPCache(llama, max_cache_tokens=cap, **chosen, **options)
            assert nll[f"{name}@{cap}"] == pytest.approx(hand_nll(llama, ids, PROMPT, 4, cache), abs=1e-4)
        assert abs(nll[f"kvp@{cap}"] - nll[FULL]) > 1e-4  # the cap evicts what the reading needs
        for other in ("kvp_rescore", "kvp_aged"):  # and each ranking keeps other entries
            assert abs(nll[f"{other}@{cap}"] - nll[f"kvp@{cap}"]) > 1e-6
    with pytest.raises(ValueError, match="caps must each exceed"):
        DecodeDownstreamConfig("", "", methods=["knorm"], caps=[4], sinks=2, window=3).validate()
    with pytest.raises(ValueError, match=r"age_decay must be a finite number >= 0 \(0: no decay\), got -1"):
        DecodeDownstreamConfig("", "", methods=["knorm"], age_decay=-1.0).validate()


def test_policies_ranked_otherwise_never_read_the_records_of_the_plain_ranking(tmp_path, llama):
    KVPolicy.for_model(llama, hidden_dim=8, pos_dim=4, max_positions=16).save_pretrained(tmp_path / "p")
    policies = {"p": load_policy(tmp_path / "p")}
    sha256 = policies["p"].weights_sha256
    plain = {"p": {"policy": policies["p"], "rescore": False, "age_decay": 0.0}}
    assert decode_downstream.learned_rows(policies, False, 0.0) == (plain, {"p": sha256})
    options, weights = decode_downstream.learned_rows(policies, True, 0.5)
    assert (options["p"]["rescore"], options["p"]["age_decay"]) == (True, 0.5)
    assert weights == {"p": sha256 + "+rescore+age_decay=0.5"}
    # None: each policy's own decay, named in its records.
    policies["p"].age_decay = 2.0
    options, weights = decode_downstream.learned_rows(policies, False, None)
    assert options["p"]["age_decay"] == 2.0 and weights == {"p": sha256 + "+age_decay=2"}
    assert decode_downstream.learned_rows(policies, False, 0.0) == (plain, {"p": sha256})


def test_validation_sequences_are_the_traced_ones(tmp_path, llama, monkeypatch):
    """downstream-decode rebuilds the traced sequences from collect.json; every prompt has one length,
    so a sequence whose text changed (other corpora, other code) is caught by its recorded digest,
    unless ``sources`` leaves its source out."""
    config = decode_config(tmp_path)
    splits = {"train": random_sequences(1, 0), "val": random_sequences(2, 1, sampled=True)}
    splits["val"][1].source = "code"
    write_decode_traces(llama, tmp_path, splits, config)
    traced_continuation = TraceSplit(tmp_path, "val").samples[0]["continuation_ids"]

    def rebuilt(val, sources=None):
        monkeypatch.setattr(
            decode_downstream, "decode_examples", lambda config, tokenizer: {"train": [], "val": val}
        )
        return decode_downstream.validation_sequences(tmp_path, "val", tokenizer=None, sources=sources)

    again = random_sequences(2, 1, sampled=True)
    assert [e.future_ids for e in rebuilt(again)] == [traced_continuation, splits["val"][1].future_ids]
    other = random_sequences(2, 1, sampled=True)
    other[1].future_ids = [(t + 1) % 256 for t in other[1].future_ids]
    with pytest.raises(ValueError, match="not rebuilt identically"):
        rebuilt(other)
    assert [e.uid for e in rebuilt(other, sources=["rand"])] == ["rand/0"]
    with pytest.raises(
        ValueError, match=r"sources: \['docs'\] not in this split, whose sources are \['code', 'rand'\]"
    ):
        rebuilt(other, sources=["docs"])


def test_sampled_continuations_pool_with_the_text():
    records = [{"source": s} for s in ("code", "code-sampled", "niah_single", "niah_single-after")]
    groups = source_groups(records)
    assert [r["source"] for r in groups[ALL_TEXT]] == ["code", "code-sampled"]


class BosTokenizer:
    """Byte ids after a BOS, as Gemma's tokenizer puts one before any text."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [3 + b for b in text.encode()]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}


def test_prompts_count_the_leading_bos(tmp_path, monkeypatch, prose_dir):
    """A model whose prompts start with BOS gets prompts of exactly ``prompt_tokens``, BOS first."""

    def prose(corpus, seed, max_chars, keep=None, essays_dir=None):
        return [p.read_text() for p in sorted(prose_dir.glob("*.txt"))]

    monkeypatch.setattr("train.collect.documents", prose)
    config = decode_config(tmp_path, windows={"code": 3}, val_fraction=0.0)
    examples = decode_examples(config, BosTokenizer())["train"]
    assert len(examples) == 3
    for example in examples:
        assert len(example.prompt_ids) == PROMPT and example.prompt_ids[0] == BosTokenizer.bos_token_id
        assert len(example.future_ids) == DECODE and BosTokenizer.bos_token_id not in example.prompt_ids[1:]
