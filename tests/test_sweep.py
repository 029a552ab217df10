"""The budget sweep (eval/sweep.py): one prefill per sample, batched decoding, against direct runs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from transformers import AutoTokenizer

from eval.__main__ import main, parse_methods
from eval.sweep import (
    FULL,
    AnswerDecoder,
    SweepConfig,
    encode_prompt,
    run_sweep,
    spread,
    stack_caches,
    write_outputs,
)
from kvp_cache import KVPCache, ruler
from kvp_cache.budget import parse_budget
from kvp_cache.models import MODELS
from kvp_cache.prefill import generate_after_prefill, prefill
from kvp_cache.scorers import methods

PROVENANCE_FIELDS = {
    "command",
    "kvp_cache",
    "git_commit",
    "versions",
    "device",
    "dtype",
    "threads",
    "model",
    "policy",
}


def tiny_with_chat_tokenizer():
    """The conftest tiny Llama, its vocabulary grown to SmolLM2's tokenizer (whose chat template
    RULER prompts use)."""
    tokenizer = AutoTokenizer.from_pretrained(MODELS["smollm2"].converted_dir())
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny():
    return tiny_with_chat_tokenizer()


def small_config(**overrides) -> SweepConfig:
    options = dict(
        methods=["knorm", "snapkv", "h2o"],
        budgets=[0.25, 16],
        tasks=["niah_single", "vt"],
        context_tokens=192,
        samples=2,
        max_new_tokens=6,
        separate_samples=4,
        separate_runs=None,
    )
    return SweepConfig(**{**options, **overrides})


@pytest.mark.parametrize("question_after", [False, True])
def test_sweep_answers_equal_separate_runs(tiny, question_after):
    model, tokenizer = tiny
    config = small_config(question_after=question_after)
    result = run_sweep(model, tokenizer, config)
    grid = 1 + len(config.methods) * len(config.budgets)
    assert len(result["records"]) == len(config.tasks) * config.samples * grid
    cost = result["cost"]
    # Every answer of every sample was also produced by its own generate call: same text.
    assert cost["separate_timed_runs"] == len(config.tasks) * config.samples * grid
    assert cost["separate_answers_differing"] == 0
    assert cost["ratio_same_samples"] > 0 and cost["sweep_seconds"] > 0


def test_full_cache_answer_is_plain_generate(tiny):
    model, tokenizer = tiny
    config = small_config(tasks=["niah_single"], samples=1, separate_samples=0)
    sample = ruler.make_samples("niah_single", tokenizer, 192, 1)[0]
    prompt = encode_prompt(sample, tokenizer, False, torch.device("cpu"))
    out = model.generate(prompt.full, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    decoder = AnswerDecoder(model, tokenizer, config.sink_tokens, config.window_tokens)
    expected = decoder.decode(out[0, prompt.full.shape[1] :])
    record = next(r for r in run_sweep(model, tokenizer, config)["records"] if r["method"] == FULL)
    assert record["prediction"] == expected


def test_budget_covering_the_prompt_gives_the_full_answer(tiny):
    model, tokenizer = tiny
    config = small_config(budgets=[1.0, 4096], separate_samples=0)
    records = run_sweep(model, tokenizer, config)["records"]
    full = {(r["task"], r["index"]): r["prediction"] for r in records if r["method"] == FULL}
    assert all(r["prediction"] == full[(r["task"], r["index"])] for r in records)


def test_stacked_caches_decode_like_each_alone(tiny):
    model, tokenizer = tiny
    ids = torch.randint(10, 1000, (1, 60))
    prefilled = prefill(model, ids)
    caches = [
        KVPCache.from_prefill(prefilled, model, method=m, budget=12) for m in ("knorm", "tova", "random")
    ]
    alone = [
        generate_after_prefill(
            model, prefilled, KVPCache.from_prefill(prefilled, model, method=m, budget=12), 5
        )
        for m in ("knorm", "tova", "random")
    ]
    stacked = stack_caches(caches)
    assert stacked.evicting_layers[0].keys.shape[0] == 3
    for layer, row in zip(stacked.evicting_layers, caches[1].evicting_layers, strict=True):
        torch.testing.assert_close(layer.keys[1:2], row.keys)
    first = prefilled.next_token_logits.argmax(-1, keepdim=True).expand(3, 1)
    batch_ids = torch.cat([ids.expand(3, -1), first], -1)
    out = model.generate(
        batch_ids,
        attention_mask=torch.ones_like(batch_ids),
        cache=stacked,
        max_new_tokens=4,
        do_sample=False,
    )
    for row, expected in zip(out[:, 60:], alone, strict=True):
        assert torch.equal(row, expected[0])
    other = KVPCache.from_prefill(prefilled, model, method="knorm", budget=20)
    with pytest.raises(ValueError, match="differ in kept"):
        stack_caches([caches[0], other])


def test_tables_are_means_of_records(tiny):
    model, tokenizer = tiny
    config = small_config(separate_samples=0)
    result = run_sweep(model, tokenizer, config)
    records = result["records"]
    for task in config.tasks:
        for method in config.methods:
            for budget in config.budgets:
                scores = [
                    r["score"]
                    for r in records
                    if (r["task"], r["method"], r["budget"]) == (task, method, budget)
                ]
                assert result["tables"][task][method][str(budget)] == pytest.approx(sum(scores) / len(scores))
    per_task = [result["tables"][t][FULL] for t in config.tasks]
    assert result["tables"]["all"][FULL] == pytest.approx(sum(per_task) / len(per_task))
    for r in records:
        assert r["score"] == ruler.score(ruler.Sample(r["task"], "", "", r["answers"], ""), r["prediction"])


def test_outputs_and_cli(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setattr("eval.__main__.load_model", lambda name, device: (model, tokenizer))
    monkeypatch.setattr("sys.argv", ["python -m eval", "sweep"])
    out = tmp_path / "sweep"
    code = main(
        ["sweep", "--methods", "knorm,tova", "--budgets", "0.5,8", "--task", "niah_single", "--context-tokens", "160",
         "--samples", "2", "--max-new-tokens", "4", "--separate-runs", "2", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    assert result["config"]["budgets"] == [0.5, 8] and result["cost"]["separate_timed_runs"] == 2
    assert next(iter(result)) == "provenance" and set(result["provenance"]) == PROVENANCE_FIELDS
    assert (
        result["provenance"]["command"] == "python -m eval sweep" and result["provenance"]["policy"] is None
    )
    assert result["provenance"]["model"] == "smollm2" and result["provenance"]["dtype"] == "float32"
    assert set(result["provenance"]["versions"]) >= {"torch", "transformers", "lm_eval"}
    table = (out / "table.md").read_text()
    assert "| full cache |" in table and "| tova |" in table and "budget 8" in table
    assert (out / "accuracy_vs_budget.png").read_bytes()[:4] == b"\x89PNG"
    # write_outputs on the loaded JSON reproduces the same table.
    write_outputs(result, tmp_path / "again")
    assert (tmp_path / "again" / "table.md").read_text() == table


def test_config_errors():
    with pytest.raises(ValueError, match="unknown methods"):
        small_config(methods=["nope"])
    with pytest.raises(ValueError, match="needs policy"):
        small_config(methods=["kvp"])
    with pytest.raises(ValueError, match="budget"):
        small_config(budgets=[1.5])
    with pytest.raises(ValueError, match="tasks"):
        small_config(tasks=["qa"])
    with pytest.raises(ValueError, match="separate_samples"):
        small_config(separate_samples=5)
    with pytest.raises(ValueError, match="samples"):
        small_config(samples=0)
    with pytest.raises(ValueError, match="split must be one of train, val, test"):
        small_config(split="eval")


def test_parsers_and_spread():
    assert parse_budget("0.25") == 0.25 and parse_budget("128") == 128
    assert parse_methods("all", None) == methods(learned=False)
    assert "kvp" in parse_methods("all", "some-policy")
    assert parse_methods("knorm, tova", None) == ["knorm", "tova"]
    grid = list(range(10))
    assert spread(grid, 3) == [0, 4, 9]
    assert spread(grid, None) == grid and spread(grid, 20) == grid and spread(grid, 1) == [0]


def test_question_appended_whole_gives_the_token_by_token_answers(tiny):
    """compress="first_prefill" caches take the question in one forward; the answers are those of
    feeding it one token at a time into default caches."""
    model, tokenizer = tiny
    config = small_config(question_after=True, separate_samples=0, methods=["knorm", "snapkv", "tova"])
    whole = run_sweep(model, tokenizer, config)["records"]
    token_by_token = run_sweep(model, tokenizer, small_config(**{**vars(config), "question_whole": False}))
    assert [r["prediction"] for r in whole] == [r["prediction"] for r in token_by_token["records"]]
    assert len({r["prediction"] for r in whole}) > 1  # the methods answer differently: a real comparison
