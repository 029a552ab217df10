"""Scores comparable across heads: the ``cross_head_scores`` contract of every method that offers it
(shapes, -inf on invalid entries, each entry's share of its head's attention against references),
the learned policy's calibration (round trip, strict loading) and ``train calibrate``'s fit."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from conftest import tiny_model
from reference import ids
from safetensors.torch import save_file
from test_policy import tiny_policy

from kvp_cache.capture import append_queries
from kvp_cache.compat import evicting_layer_indices
from kvp_cache.policy import Calibration, calibrated_shares, load_policy
from kvp_cache.prefill import prefill
from kvp_cache.scorers import make_scorer, methods
from kvp_cache.scorers.registry import SCORERS
from train import calibrate

PROMPT = 40
COMPARABLE = {"kvp", "snapkv", "tova", "h2o", "expected_attention"}


def prefilled_llama():
    model = tiny_model("llama")
    return model, prefill(model, ids(length=PROMPT, seed=4))


def raw_scores(scorer, model, prefilled, layer: int) -> torch.Tensor:
    """``[1, kv_heads, PROMPT]``: what the cache hands ``cross_head_scores`` after a prefill."""
    states = prefilled.cache.layers[layer]
    queries = (
        append_queries(None, prefilled.queries[layer], scorer.query_window) if scorer.needs_queries else None
    )
    positions = torch.arange(PROMPT)[None]
    return scorer.score(states.keys, states.values, positions, queries, layer)


def random_calibration(policy, seed: int = 0) -> Calibration:
    generator = torch.Generator().manual_seed(seed)
    shape = (len(policy.layer_indices), policy.num_kv_heads)
    return Calibration(
        temperature=0.5 + torch.rand(shape, generator=generator),
        weight=0.2 + 2 * torch.rand(shape, generator=generator),
        record={"variant": "tau_w", "loss": "mass"},
    )


def scorers(model):
    calibrated = tiny_policy(model, seed=1)
    calibrated.calibration = random_calibration(calibrated)
    return {
        "kvp": make_scorer("kvp", policy=tiny_policy(model)),
        "kvp calibrated": make_scorer("kvp", policy=calibrated),
        "snapkv": make_scorer("snapkv", window_size=8, kernel_size=1),
        "tova": make_scorer("tova"),
        "h2o": make_scorer("h2o"),
        "h2o normalize": make_scorer("h2o", normalize=True),
        "expected_attention": make_scorer("expected_attention", use_vnorm=False, epsilon=0.25),
        "expected_attention vnorm": make_scorer("expected_attention"),
    }


@pytest.mark.parametrize("name", list(scorers(tiny_model("llama"))))
def test_contract_shapes_and_invalid_entries(name):
    model, prefilled = prefilled_llama()
    scorer = scorers(model)[name]
    assert scorer.comparable_across_heads
    valid = (
        torch.rand(1, model.config.num_key_value_heads, PROMPT, generator=torch.Generator().manual_seed(2))
        > 0.3
    )
    for layer in evicting_layer_indices(model.config):
        values = scorer.cross_head_scores(raw_scores(scorer, model, prefilled, layer), valid, layer)
        assert values.shape == valid.shape and values.dtype == torch.float32
        assert torch.isneginf(values[~valid]).all()
        assert torch.isfinite(values[valid]).all()


def head_sums(values: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(torch.isneginf(values), 0.0).sum(-1)


@pytest.mark.parametrize("name", ["kvp", "tova", "h2o", "expected_attention"])
def test_every_head_shares_one_unit_of_attention(name):
    """The shares of one head add up to 1 (its queries' attention), in every head and layer."""
    model, prefilled = prefilled_llama()
    scorer = scorers(model)[name]
    valid = torch.ones(1, model.config.num_key_value_heads, PROMPT, dtype=torch.bool)
    for layer in evicting_layer_indices(model.config):
        values = scorer.cross_head_scores(raw_scores(scorer, model, prefilled, layer), valid, layer)
        torch.testing.assert_close(head_sums(values), torch.ones(1, valid.shape[1]))


def test_calibrated_kvp_is_weight_times_softmax_at_temperature():
    model, prefilled = prefilled_llama()
    scorer = scorers(model)["kvp calibrated"]
    calibration = scorer.policy.calibration
    valid = torch.ones(1, model.config.num_key_value_heads, PROMPT, dtype=torch.bool)
    valid[..., :3] = False
    for row, layer in enumerate(evicting_layer_indices(model.config)):
        raw = raw_scores(scorer, model, prefilled, layer)
        values = scorer.cross_head_scores(raw, valid, layer)
        for head in range(valid.shape[1]):
            tau, w = calibration.temperature[row, head], calibration.weight[row, head]
            expected = w * torch.exp(raw[0, head, 3:] / tau) / torch.exp(raw[0, head, 3:] / tau).sum()
            torch.testing.assert_close(values[0, head, 3:], expected)
        torch.testing.assert_close(head_sums(values)[0], calibration.weight[row])


def test_snapkv_shares_are_the_window_queries_attention():
    model, prefilled = prefilled_llama()
    scorer = scorers(model)["snapkv"]
    layer = 1
    raw = raw_scores(scorer, model, prefilled, layer)
    values = scorer.cross_head_scores(raw, torch.ones_like(raw, dtype=torch.bool), layer)
    # Reference: softmax attention of the last 8 queries, by a plain loop over query heads.
    queries = prefilled.queries[layer].queries[0]  # [q_heads, PROMPT, d]
    keys = prefilled.cache.layers[layer].keys[0]
    group = queries.shape[0] // keys.shape[0]
    for head in range(keys.shape[0]):
        per_query_head = []
        for g in range(group):
            q = queries[head * group + g, -8:]
            logits = (q @ keys[head].T) * prefilled.queries[layer].scaling
            logits = logits.masked_fill(
                torch.arange(PROMPT)[None] > torch.arange(PROMPT - 8, PROMPT)[:, None], -1e9
            )
            per_query_head.append(logits.softmax(-1).mean(0))
        expected = torch.stack(per_query_head).mean(0)
        torch.testing.assert_close(values[0, head, :-8], expected[:-8])
        assert (values[0, head, -8:] == torch.finfo(torch.float32).max).all()  # the window comes first


def test_h2o_shares_scale_every_layer_by_the_same_query_count():
    model, prefilled = prefilled_llama()
    scorer = scorers(model)["h2o"]
    valid = torch.ones(1, model.config.num_key_value_heads, PROMPT, dtype=torch.bool)
    for layer in evicting_layer_indices(model.config):
        raw = raw_scores(scorer, model, prefilled, layer)
        torch.testing.assert_close(scorer.cross_head_scores(raw, valid, layer), raw / PROMPT)


def test_methods_without_comparable_scores_refuse():
    offered = {name for name in methods() if SCORERS[name].comparable_across_heads}
    assert offered == COMPARABLE
    for name in sorted(set(methods()) - COMPARABLE):
        scorer = make_scorer(name)
        with pytest.raises(ValueError, match="allocation='uniform' only"):
            scorer.cross_head_scores(torch.zeros(1, 2, 4), torch.ones(1, 2, 4, dtype=torch.bool), 0)


def test_uncalibrated_policy_is_the_per_head_softmax():
    model, prefilled = prefilled_llama()
    scorer = scorers(model)["kvp"]
    raw = raw_scores(scorer, model, prefilled, 0)
    values = scorer.cross_head_scores(raw, torch.ones_like(raw, dtype=torch.bool), 0)
    torch.testing.assert_close(values, raw.softmax(-1))


# ---- saving and loading a calibration ---------------------------------------------------------


def saved(tmp_path, model=None):
    policy = tiny_policy(model or tiny_model("llama"), seed=3)
    policy.calibration = random_calibration(policy, seed=5)
    policy.save_pretrained(tmp_path / "policy")
    return policy, tmp_path / "policy"


def test_calibration_round_trip(tmp_path):
    policy, path = saved(tmp_path)
    loaded = load_policy(path)
    assert torch.equal(loaded.calibration.temperature, policy.calibration.temperature)
    assert torch.equal(loaded.calibration.weight, policy.calibration.weight)
    assert loaded.calibration.record == {"variant": "tau_w", "loss": "mass"}
    file_sha = hashlib.sha256((path / "calibration.safetensors").read_bytes()).hexdigest()
    assert loaded.calibration_sha256 == file_sha
    assert json.loads((path / "config.json").read_text())["calibration"]["sha256"] == file_sha
    assert "## Calibration" in (path / "README.md").read_text()
    scores, valid = torch.randn(2, 2, 7), torch.rand(2, 2, 7) > 0.2
    torch.testing.assert_close(
        loaded.cross_head_scores(1, scores, valid), policy.cross_head_scores(1, scores, valid)
    )
    policy.calibration = None  # saving without one removes the file, and the policy loads plain
    policy.save_pretrained(path)
    assert not (path / "calibration.safetensors").exists()
    plain = load_policy(path)
    assert plain.calibration is None and plain.calibration_sha256 is None
    assert loaded.weights_sha256 == plain.weights_sha256  # the calibration leaves the weights alone


def rewrite(path, tensors: dict | None = None, raw: bytes | None = None) -> None:
    """Replace calibration.safetensors and record its new sha256, so only its content is wrong."""
    file = path / "calibration.safetensors"
    if raw is None:
        save_file(tensors, str(file))
    else:
        file.write_bytes(raw)
    config = json.loads((path / "config.json").read_text())
    config["calibration"]["sha256"] = hashlib.sha256(file.read_bytes()).hexdigest()
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"temperature": torch.ones(2, 2)}, r"missing keys: \['weight'\]"),
        (
            {"temperature": torch.ones(2, 2), "weight": torch.ones(2, 2), "bias": torch.ones(2, 2)},
            r"unexpected keys: \['bias'\]",
        ),
        ({"temperature": torch.ones(2, 3), "weight": torch.ones(2, 3)}, r"shape mismatches.*\(2, 3\)"),
        ({"temperature": -torch.ones(2, 2), "weight": torch.ones(2, 2)}, "finite and positive"),
    ],
    ids=["missing", "extra", "shape", "negative"],
)
def test_calibration_loads_strictly(tmp_path, tensors, message):
    _, path = saved(tmp_path)
    rewrite(path, tensors)
    with pytest.raises(ValueError, match=message):
        load_policy(path)


def test_pickled_calibration_is_refused_without_unpickling(tmp_path, monkeypatch):
    import io

    _, path = saved(tmp_path)
    buffer = io.BytesIO()
    torch.save({"temperature": torch.ones(2, 2), "weight": torch.ones(2, 2)}, buffer)
    rewrite(path, raw=buffer.getvalue())

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(ValueError, match="calibration.safetensors is not a valid safetensors file"):
        load_policy(path)


def test_calibration_and_config_must_agree(tmp_path):
    _, path = saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**config, "calibration": {**config["calibration"], "sha256": "0" * 64}})
    )
    with pytest.raises(ValueError, match="belongs to another policy or was edited"):
        load_policy(path)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "calibration"}))
    with pytest.raises(ValueError, match="config.json records no calibration"):
        load_policy(path)
    (path / "config.json").write_text(json.dumps(config))
    (path / "calibration.safetensors").unlink()
    with pytest.raises(ValueError, match="records a calibration but calibration.safetensors is missing"):
        load_policy(path)


def test_calibration_must_fit_the_policy():
    policy = tiny_policy(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"must be \[evicting layers, kv_heads\] = \[2, 2\]"):
        policy.calibration = Calibration(torch.ones(3, 2), torch.ones(3, 2))
    with pytest.raises(ValueError, match="finite and positive"):
        Calibration(torch.zeros(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="same shape"):
        Calibration(torch.ones(2, 2), torch.ones(2, 1))


# ---- train calibrate --------------------------------------------------------------------------


@pytest.mark.parametrize("loss", list(calibrate.LOSSES))
def test_fit_recovers_known_temperatures_and_weights(loss):
    """Targets made by a known calibration of the scores: the fit finds it again (weights up to one
    common factor, which a distribution over every entry cannot see)."""
    generator = torch.Generator().manual_seed(0)
    scores = 0.7 * torch.randn(6, 3, 2, 24, generator=generator)  # shares well above LOG_FLOOR
    temperature = torch.tensor([[0.5, 1.0], [2.0, 0.8], [1.3, 0.6]])
    weight = torch.tensor([[1.0, 0.3], [2.0, 0.6], [0.5, 1.5]])
    evictable = torch.ones(24, dtype=torch.bool)
    evictable[:2] = False
    target = calibrated_shares(scores, torch.ones_like(scores, dtype=torch.bool), temperature, weight)
    target = target * evictable
    tau, w, losses = calibrate.fit(scores, target, evictable, "tau_w", loss, steps=400, lr=0.05)
    assert losses[-1] < losses[0]
    torch.testing.assert_close(tau, temperature, atol=0.03, rtol=0.03)
    torch.testing.assert_close(w / w.mean(), weight / weight.mean(), atol=0.03, rtol=0.03)
    only_tau, ones, _ = calibrate.fit(scores, target, evictable, "tau", loss, steps=5, lr=0.05)
    assert torch.equal(ones, torch.ones(3, 2)) and not torch.equal(only_tau, torch.ones(3, 2))


def test_oracle_driven_allocation_loses_least_per_head():
    generator = torch.Generator().manual_seed(1)
    target = torch.rand(2, 2, 2, 64, generator=generator) ** 4
    drivers = {"oracle": target, "noise": torch.rand(2, 2, 2, 64, generator=generator)}
    lost = calibrate.summarize_lost(calibrate.lost_attention(drivers, target, [0, 1], [0.25], 2, 3))
    assert lost["oracle"]["uniform@0.25"] < lost["noise"]["uniform@0.25"]
    assert lost["oracle"]["head@0.25"] <= lost["oracle"]["uniform@0.25"]


@pytest.mark.parametrize("held_out", [True, False])
def test_windows_come_from_one_side_of_the_document_split(held_out, monkeypatch):
    from train.data import is_held_out_document

    seen = {}

    def documents(name, seed, max_chars, essays_dir=None, keep=None):
        texts = [f"document {i} " * 400 for i in range(60)]
        seen["kept"] = [keep(text) for text in texts]
        seen["held"] = [is_held_out_document(text, 0.3) for text in texts]
        return [text for text in texts if keep(text)]

    class Tokenizer:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1 + len(word) for word in text.split()]}

    monkeypatch.setattr(calibrate, "documents", documents)
    windows = calibrate.corpus_windows(Tokenizer(), "code", 2, 16, 4, 0, 0.3, held_out=held_out)
    assert len(windows) == 2 and all(len(w.prompt_ids) == 16 and len(w.future_ids) == 4 for w in windows)
    assert seen["kept"] == [held == held_out for held in seen["held"]]
    assert any(seen["held"]) and not all(seen["held"])


def test_calibrate_runs_end_to_end_on_prompts_that_start_with_a_bos(tmp_path, monkeypatch):
    """A base model's tokenizer adds <bos> (Gemma 3): each prompt is context_tokens + 1 entries, and
    the fit, the check and the calibrated policies follow the measured length."""
    model = tiny_model("llama")
    tiny_policy(model).save_pretrained(tmp_path / "policy")

    class BosTokenizer:
        eos_token_id, bos_token_id = 0, 2

        def __call__(self, text, add_special_tokens=True):
            words = [3 + len(word) % 50 for word in text.split()]
            return {"input_ids": ([2] if add_special_tokens else []) + words}

    def documents(name, seed, max_chars, essays_dir=None, keep=None):
        texts = [" ".join(f"w{i}x{j % 17}" for j in range(300)) for i in range(40)]
        return [text for text in texts if keep(text)]

    monkeypatch.setattr(calibrate, "documents", documents)
    config = calibrate.CalibrateConfig(
        model="tiny",
        policy=str(tmp_path / "policy"),
        out=str(tmp_path / "out"),
        windows={"code": 4},
        context_tokens=32,
        continuation_tokens=8,
        check_fraction=0.5,
        steps=5,
        budgets=[0.25],
    )
    result = calibrate.calibrate(config, model=model, tokenizer=BosTokenizer(), command=["test"])
    assert set(result["variants"]) == set(calibrate.VARIANTS)
    assert all(0 <= v <= 1 for cells in result["lost_attention"].values() for v in cells.values())
    calibrated = load_policy(tmp_path / "out" / "policy-tau_w")
    assert calibrated.calibration is not None
