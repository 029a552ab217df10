"""eval.headroom's masked forward: the model's own with nothing hidden, the reference's per-head
mask (tests/reference.py) for any per-head counts, and KVPCache's oracle row for the uniform one;
the other score kinds: their shapes, and KVPCache's kvp and snapkv rows for the uniform allocation."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from reference import Snapshot, ids, reference_logits
from test_policy import tiny_policy

from eval.headroom import (
    HEADROOM_ATTENTION,
    PERPLEXITY,
    SCORE_KINDS,
    SCORER_OF,
    WEIGHT_WINDOW,
    HeadroomConfig,
    compare_tables,
    entry_scores,
    future_nll,
    main,
    prompt_mask,
    summarize,
    window_attention,
)
from eval.oracle import OracleScorer, oracle_scorer
from kvp_cache.allocation import MODES, allocate
from kvp_cache.cache import KVPCache
from kvp_cache.compat import evicting_layer_indices
from kvp_cache.integrations import forward_tokens
from kvp_cache.policy import Calibration
from kvp_cache.prefill import prefill
from kvp_cache.provenance import portable_config
from kvp_cache.scorers import make_scorer
from kvp_cache.targets import evictable_only

PROMPT, FUTURE = 40, 9


def setup(kind: str):
    model = tiny_model(kind)
    tokens = ids(length=PROMPT + FUTURE, seed=3)
    prompt, future = tokens[:, :PROMPT], tokens[:, PROMPT:]
    return model, tokens, prefill(model, prompt), future


def future_logits(model, prefilled, future, kept) -> torch.Tensor:
    with prompt_mask(model, kept):
        return forward_tokens(model, copy.deepcopy(prefilled.cache), future).float()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_nothing_hidden_is_the_models_own_forward(kind):
    model, _, prefilled, future = setup(kind)
    heads = model.config.num_key_value_heads
    kept = {i: torch.ones(heads, PROMPT, dtype=torch.bool) for i in evicting_layer_indices(model.config)}
    plain = forward_tokens(model, copy.deepcopy(prefilled.cache), future).float()
    torch.testing.assert_close(future_logits(model, prefilled, future, kept), plain, atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation != HEADROOM_ATTENTION  # restored


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_uneven_heads_match_the_reference_mask(kind):
    model, tokens, prefilled, future = setup(kind)
    generator = torch.Generator().manual_seed(0)
    scores = {
        i: torch.rand(model.config.num_key_value_heads, PROMPT, generator=generator) ** (4 * (i % 2) + 1)
        for i in evicting_layer_indices(model.config)
    }
    kept = allocate(scores, 0.3, "head", min_per_head=2, sink_tokens=2, window_tokens=3)
    counts = torch.stack([mask.sum(-1) for mask in kept.values()])
    assert counts.min() < counts.max()  # the heads keep different numbers of entries
    snapshot = {}
    for layer, mask in kept.items():
        # The reference takes equal-length position lists: pad a head's with its first kept position.
        width = int(mask.sum(-1).max())
        positions = torch.stack(
            [torch.cat([row.nonzero()[:, 0], row.nonzero()[:1, 0].repeat(width)])[:width] for row in mask]
        )
        snapshot[layer] = (positions[None], torch.ones(1, width, dtype=torch.bool))
    expected = reference_logits(model, tokens, [Snapshot(PROMPT, FUTURE, snapshot)])[:, PROMPT:]
    masked = future_logits(model, prefilled, future, kept)
    torch.testing.assert_close(masked, expected, atol=2e-4, rtol=1e-4)
    plain = forward_tokens(model, copy.deepcopy(prefilled.cache), future).float()
    assert (masked - plain).abs().max() > 1e-3  # the mask hides something


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_uniform_oracle_is_the_caches_oracle_row(kind):
    model, _, prefilled, future = setup(kind)
    importance = oracle_scorer(model, prefilled, future[0].tolist()).importance
    protected = dict(sink_tokens=2, window_tokens=3)  # 15 of the 20 kept entries chosen by score
    cache = KVPCache.from_prefill(
        prefilled, model, method=OracleScorer(importance), budget=0.5, compress="first_prefill", **protected
    )
    expected = forward_tokens(model, cache, future).float()
    kept = allocate(importance, 0.5, "uniform", **protected)
    torch.testing.assert_close(future_logits(model, prefilled, future, kept), expected, atol=2e-4, rtol=1e-4)


def scorer_of(kind: str, model):
    """A small scorer per kind: a random tiny policy (calibrated for ``kvp_calibrated``), SnapKV with
    a window shorter than the prompt, the other baselines as registered."""
    if kind == "oracle":
        return None
    if kind == "snapkv":
        return make_scorer("snapkv", window_size=8)
    if SCORER_OF[kind] != "kvp":
        return make_scorer(SCORER_OF[kind])
    policy = tiny_policy(model)
    if kind in ("kvp_calibrated", "kvp_oracle_weights", "kvp_window_weights"):
        shape = (len(policy.layer_indices), policy.num_kv_heads)
        policy.calibration = Calibration(
            torch.linspace(0.5, 2, shape[0] * shape[1]).view(shape), 3 * torch.ones(shape)
        )
    return make_scorer("kvp", policy=policy)


def test_every_score_kind_scores_every_evicting_head():
    model, _, prefilled, future = setup("gemma3")
    heads = model.config.num_key_value_heads
    scores = {
        kind: entry_scores(kind, scorer_of(kind, model), model, prefilled, future[0].tolist())
        for kind in SCORE_KINDS
    }
    for kind, by_layer in scores.items():
        assert list(by_layer) == evicting_layer_indices(model.config), kind
        assert all(s.shape == (heads, PROMPT) and s.dtype == torch.float32 for s in by_layer.values()), kind
    for layer, importance in scores["oracle"].items():  # the oracle allocates, the policy only picks
        assert torch.equal(scores["kvp_oracle_counts"][layer], importance)
    policy = scorer_of("kvp", model)  # the same seed: the same policy as above
    raw = entry_scores("kvp_raw", policy, model, prefilled, [])
    for layer, shares in entry_scores("kvp", policy, model, prefilled, []).items():
        torch.testing.assert_close(shares, raw[layer].softmax(-1))
        assert raw[layer].std() > 0
    calibrated = scorer_of("kvp_calibrated", model)
    for layer, values in entry_scores("kvp_calibrated", calibrated, model, prefilled, []).items():
        expected = calibrated.policy.cross_head_scores(
            layer, raw[layer][None], torch.ones(1, heads, PROMPT) > 0
        )
        torch.testing.assert_close(values, expected[0])
        torch.testing.assert_close(values.sum(-1), torch.full((heads,), 3.0))  # the weight, not 1
        # The oracle's weights keep the calibrated shape and give each head its evictable oracle mass.
        reweighted = scores["kvp_oracle_weights"][layer]
        mass = evictable_only(scores["oracle"][layer], 4, 16).sum(-1)
        torch.testing.assert_close(reweighted.sum(-1), mass)
        torch.testing.assert_close(reweighted / mass[:, None], values / 3.0)
        # The window's weights: the last queries' attention, each query's row summing to 1.
        attention = window_attention(model, prefilled, WEIGHT_WINDOW)[layer]
        torch.testing.assert_close(attention.sum(-1), torch.ones(heads))
        windowed = scores["kvp_window_weights"][layer]
        torch.testing.assert_close(windowed.sum(-1), evictable_only(attention, 4, 16).sum(-1))


def fake_summary(shift: float, layers: int = 30) -> dict:
    """A summary of 4 made-up text windows over ``layers`` evicting layers: every allocation's NLL is
    the full cache's plus a known amount, ``head`` ``shift`` below ``uniform``."""
    config = HeadroomConfig(windows={"code": 4}, samples=0, text_budgets=[0.05, 0.1])
    records = [
        {
            "uid": f"code/{i}",
            "tokens": f"digest{i}",
            "source": "code",
            "protocol": PERPLEXITY,
            "nll": {"full": 1.0 + i}
            | {
                f"{mode}@{b}": 1.0 + i + b + (0.1 if mode == "uniform" else 0.1 - shift)
                for mode in MODES
                for b in (0.05, 0.1)
            },
            "head_layer_share": {"0.05": [0.1] * layers, "0.1": [0.2] * 3 + [0.05] * (layers - 3)},
        }
        for i in range(4)
    ]
    return {
        "config": portable_config(config),
        "evicting_layers": list(range(layers)),
        **summarize(records, config),
        "records": records,
    }


def test_compare_rewrites_only_the_generated_tables(tmp_path):
    paths = {}
    for label, shift in (("one", 0.03), ("two", -0.02)):
        summary = fake_summary(shift)
        # Needles the two answer differently: "two" finds one needle fewer of 2 under uniform at 5%.
        summary["records"] += [
            {"uid": f"niah/{i}", "tokens": f"n{i}", "protocol": "question_in",
             "scores": {"full": 1.0, "uniform@0.05": float(label == "one" or i == 0), "head@0.05": 1.0},
             "nll": {"full": 0.5, "uniform@0.05": 0.5 + shift, "head@0.05": 0.5}}
            for i in range(2)
        ]  # fmt: skip
        paths[label] = tmp_path / f"{label}.json"
        paths[label].write_text(json.dumps(summary))
    report = tmp_path / "report.md"
    report.write_text(
        "# Prose\n\n<!-- tables generated by: old -->\nstale\n<!-- end of generated tables -->\n\nVerdict.\n"
    )
    specs = [f"{label}={path}" for label, path in paths.items()]
    main(["--report", str(report), "--compare", *specs, "--against", "one"])
    text = report.read_text()
    assert text.startswith("# Prose\n\n<!-- tables generated by: python -m eval.headroom --report ")
    assert text.endswith("<!-- end of generated tables -->\n\nVerdict.\n") and "stale" not in text
    assert "| one | head − uniform | -0.030 (-0.030 to -0.030) | -0.030 (-0.030 to -0.030) |" in text
    assert "| two | head − uniform | +0.020 (+0.020 to +0.020) | +0.020 (+0.020 to +0.020) |" in text
    assert "| one | uniform | +0.150 (+0.150 to +0.150) | +0.200 (+0.200 to +0.200) |" in text
    assert "| one | 0.1 | 0.200, 0.200, 0.200 | 0.050 | 0.050 |" in text
    assert (
        "| two (n=4) | perplexity NLL: head − one head | +0.050 (+0.050 to +0.050) | +0.050 (+0.050 to +0.050) |"
        in text
    )
    assert "| two (n=4) | perplexity NLL: uniform − one uniform | +0.000 (+0.000 to +0.000) |" in text
    assert (
        "| two (n=2) | question_in accuracy: uniform − one uniform | -0.500 (-1.000 to +0.000) | - |" in text
    )
    assert "| two (n=2) | question_in accuracy: head − one head | +0.000 (+0.000 to +0.000) | - |" in text
    assert (
        "| two (n=2) | question_in answer NLL: uniform − one uniform | -0.050 (-0.050 to -0.050) | - |"
        in text
    )
    report.write_text("no block\n")
    with pytest.raises(ValueError, match="has no generated block"):
        main(["--report", str(report), "--compare", f"one={paths['one']}"])


def test_compare_of_needle_only_summaries_pairs_the_needles():
    config = HeadroomConfig(windows={}, samples=3, needle_budgets=[0.1], protocols=["question_in"])
    summaries = {}
    for label, shift in (("one", 0.0), ("two", 0.25)):
        records = [
            {"uid": f"niah_single/{i}", "tokens": f"n{i}", "source": "niah_single", "protocol": "question_in",
             "scores": {"full": 1.0} | {f"{mode}@0.1": 1.0 for mode in MODES},
             "nll": {"full": 0.5} | {f"{mode}@0.1": 0.5 + shift for mode in MODES},
             "head_layer_share": {"0.1": [0.1] * 30}}
            for i in range(3)
        ]  # fmt: skip
        summaries[label] = {
            "config": portable_config(config),
            "evicting_layers": list(range(30)),
            **summarize(records, config),
            "records": records,
        }
    text = compare_tables(summaries, "one")
    assert "## Text" not in text and "Where `head` puts the entries" not in text
    assert "| scores | difference | @0.1 |" in text
    assert "| two (n=3) | question_in answer NLL: uniform − one uniform | +0.250 (+0.250 to +0.250) |" in text
    assert "| two (n=3) | question_in accuracy: head − one head | +0.000 (+0.000 to +0.000) |" in text


def test_compare_lists_every_layer_of_a_model_that_evicts_on_three():
    text = compare_tables({"one": fake_summary(0.03, layers=3), "two": fake_summary(0.0, layers=3)}, "one")
    assert "| scores | budget | layer 0, layer 1, layer 2 |" in text
    assert "| one | 0.1 | 0.200, 0.200, 0.200 |" in text


@pytest.mark.parametrize("kind", ["kvp", "snapkv"])
@pytest.mark.parametrize("model_kind", ["llama", "gemma3"])
def test_uniform_allocation_is_the_caches_row(kind, model_kind):
    model, _, prefilled, future = setup(model_kind)
    scorer = scorer_of(kind, model)
    protected = dict(sink_tokens=2, window_tokens=3)
    cache = KVPCache.from_prefill(
        prefilled, model, method=scorer, budget=0.3, compress="first_prefill", **protected
    )
    expected = forward_tokens(model, cache, future).float()
    kept = allocate(entry_scores(kind, scorer, model, prefilled, []), 0.3, "uniform", **protected)
    torch.testing.assert_close(future_logits(model, prefilled, future, kept), expected, atol=2e-4, rtol=1e-4)


def test_future_nll_scores_the_answer_after_the_question():
    model, tokens, prefilled, future = setup("llama")
    question, answer = future[0, :4].tolist(), future[0, 4:].tolist()
    logits = model(tokens).logits[0, PROMPT + 3 : -1].float()  # the positions that predict the answer
    expected = F.cross_entropy(logits, future[0, 4:]).item()
    assert abs(future_nll(model, prefilled, question, answer) - expected) < 1e-4
    whole = F.cross_entropy(model(tokens).logits[0, PROMPT - 1 : -1].float(), future[0]).item()
    assert abs(future_nll(model, prefilled, [], future[0].tolist()) - whole) < 1e-4


def test_window_attention_is_the_models_own_attention_of_the_last_queries():
    model, tokens, prefilled, _ = setup("llama")
    model.config._attn_implementation = "eager"
    out = model(tokens[:, :PROMPT], output_attentions=True)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, attention in window_attention(model, prefilled, 8).items():
        weights = out.attentions[layer][0, :, -8:]  # [q_heads, 8, prompt]
        expected = weights.unflatten(0, (-1, group)).mean(dim=(1, 2))
        torch.testing.assert_close(attention, expected, atol=1e-5, rtol=1e-4)
