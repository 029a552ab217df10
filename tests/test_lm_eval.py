"""The ``kvp`` lm-eval model against stock ``hf`` and against hand-built compressed caches."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_CONFIGS
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from kvp_cache import KVPCache  # noqa: E402
from kvp_cache.integrations import cache_kwarg, forward_tokens  # noqa: E402
from kvp_cache.integrations.lm_eval import KVPLM, SPLIT_MARKER, split_at_marker  # noqa: E402
from kvp_cache.models import MODELS  # noqa: E402

HEAD = "The quick brown fox jumps over the lazy dog.\n" * 6
QUESTION = "Question: what did the fox do?\nAnswer:"
CONTEXT = HEAD + QUESTION
CHOICES = [" yes", " no", " it jumped over it", " a b c d e f"]
GEN = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}
TASKS_DIR = Path(__file__).resolve().parents[1] / "eval" / "tasks"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (vocab 49152), saved as lm-eval loads models."""
    torch.manual_seed(0)
    config = TINY_CONFIGS["llama"]()
    config.vocab_size, config.tie_word_embeddings = 49152, True
    path = tmp_path_factory.mktemp("tiny_llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(MODELS["smollm2"].converted_dir()).save_pretrained(path)
    return str(path)


def make_lm(cls, path, **kwargs):
    # Eager attention: SDPA's CPU kernel rounds differently for different query lengths (~1e-6).
    return cls(pretrained=path, device="cpu", attn_implementation="eager", **kwargs)


def ll_requests(context=CONTEXT, choices=CHOICES):
    return [Instance("loglikelihood", {}, (context, c), i) for i, c in enumerate(choices)]


def gen_requests(contexts):
    return [Instance("generate_until", {}, (c, dict(GEN)), i) for i, c in enumerate(contexts)]


def assert_same_scores(got, expected):
    """Equal greedy flags; log-likelihoods equal up to float32 rounding.

    Scoring the continuation in its own forward multiplies matrices of other shapes than hf's
    single forward, and CPU GEMM kernels round differently per shape (seen: ~4e-6 on a sum of -11).
    """
    assert [g for _, g in got] == [g for _, g in expected]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], rel=1e-6, abs=1e-5)


def reference_loglikelihood(model, context_ids, rest_ids, continuation, **cache_args):
    """Hand-built protocol: compress ``context_ids``, run ``rest_ids + continuation[:-1]`` on top."""
    cache = KVPCache(model, **cache_args)
    with torch.no_grad():
        logits = forward_tokens(model, cache, torch.tensor([context_ids]))[0, -1:]
        tail = rest_ids + continuation[:-1]
        if tail:
            logits = torch.cat([logits, forward_tokens(model, cache, torch.tensor([tail]))[0]])
    logprobs = torch.log_softmax(logits[-len(continuation) :], -1)
    target = torch.tensor(continuation)
    return float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())


def test_registered_and_hf_still_resolves():
    assert get_model("kvp") is KVPLM
    assert get_model("hf") is HFLM


@pytest.mark.parametrize("method", ["knorm", "snapkv"])
def test_loglikelihood_equals_hf_with_full_budget(tiny_dir, method):
    requests = ll_requests() + ll_requests("Short context:", [" x", " y z"])
    expected = make_lm(HFLM, tiny_dir, batch_size=3).loglikelihood(requests)
    for budget in (1.0, 4096):
        got = make_lm(KVPLM, tiny_dir, method=method, budget=budget).loglikelihood(requests)
        assert_same_scores(got, expected)  # in request order


def test_loglikelihood_truncation_matches_hf(tiny_dir):
    requests = ll_requests()
    expected = make_lm(HFLM, tiny_dir, max_length=24).loglikelihood(requests)
    got = make_lm(KVPLM, tiny_dir, max_length=24, budget=1.0).loglikelihood(requests)
    assert_same_scores(got, expected)


def test_loglikelihood_compresses_the_context_once(tiny_dir, monkeypatch):
    lm = make_lm(KVPLM, tiny_dir, method="knorm", budget=8, sink_tokens=2, window_tokens=2)
    built = []
    new_cache = lm.new_cache
    monkeypatch.setattr(lm, "new_cache", lambda: built.append(1) or new_cache())
    got = lm.loglikelihood(ll_requests())
    assert len(built) == 1  # four choices, one shared compressed context
    context_ids = lm.tok_encode(CONTEXT)
    for (logprob, greedy), choice in zip(got, CHOICES, strict=True):
        continuation = lm.tok_encode(CONTEXT + choice)[len(context_ids) :]
        ref = reference_loglikelihood(
            lm.model, context_ids, [], continuation, method="knorm", budget=8, sink_tokens=2, window_tokens=2
        )
        assert (logprob, greedy) == pytest.approx(ref, abs=1e-5)
    full = make_lm(HFLM, tiny_dir).loglikelihood(ll_requests())
    assert max(abs(a[0] - b[0]) for a, b in zip(got, full, strict=True)) > 1e-3  # eviction changed the scores


def test_loglikelihood_split_marker(tiny_dir):
    marked = ll_requests(HEAD + SPLIT_MARKER + QUESTION)
    plain = ll_requests(CONTEXT)
    # Nothing evicted: same numbers as stock hf on the unmarked text.
    assert make_lm(KVPLM, tiny_dir, budget=1.0).loglikelihood(marked) == make_lm(
        HFLM, tiny_dir
    ).loglikelihood(plain)
    lm = make_lm(KVPLM, tiny_dir, method="knorm", budget=8, sink_tokens=2, window_tokens=2)
    got = lm.loglikelihood(marked)
    head_ids, context_ids = lm.tok_encode(HEAD), lm.tok_encode(CONTEXT)
    assert context_ids[: len(head_ids)] == head_ids  # the marker sits on a token boundary
    for (logprob, greedy), choice in zip(got, CHOICES, strict=True):
        continuation = lm.tok_encode(CONTEXT + choice)[len(context_ids) :]
        rest = context_ids[len(head_ids) :]
        ref = reference_loglikelihood(
            lm.model, head_ids, rest, continuation, method="knorm", budget=8, sink_tokens=2, window_tokens=2
        )
        assert (logprob, greedy) == pytest.approx(ref, abs=1e-5)
    assert got != lm.loglikelihood(plain)  # compressing the question too gives other scores


def test_loglikelihood_rolling_is_stock_hf(tiny_dir):
    requests = [Instance("loglikelihood_rolling", {}, (CONTEXT * 3,), 0)]
    expected = make_lm(HFLM, tiny_dir, max_length=64).loglikelihood_rolling(requests)
    assert make_lm(KVPLM, tiny_dir, max_length=64, budget=4).loglikelihood_rolling(requests) == expected


def test_cache_hook_gets_every_answer(tiny_dir):
    lm = make_lm(KVPLM, tiny_dir, budget=0.5)
    seen = []

    class Hook:
        def add_partial(self, attr, req, res):
            seen.append((attr, req, res))

    lm.set_cache_hook(Hook())
    got = lm.loglikelihood(ll_requests())
    assert sorted(seen, key=str) == sorted(
        [("loglikelihood", (CONTEXT, c), r) for c, r in zip(CHOICES, got, strict=True)], key=str
    )


def test_generate_until_equals_hf_with_full_budget(tiny_dir):
    # Different lengths in one batch: left padding, which the cache reads from the attention mask.
    requests = gen_requests([CONTEXT, "Hello there, how", CONTEXT[:80]])
    expected = make_lm(HFLM, tiny_dir, batch_size=3).generate_until(requests)
    for method in ("knorm", "tova"):
        got = make_lm(KVPLM, tiny_dir, batch_size=3, method=method, budget=1.0).generate_until(requests)
        assert got == expected


def test_generate_until_matches_generate_with_kvpcache(tiny_dir):
    lm = make_lm(KVPLM, tiny_dir, method="knorm", budget=8)
    got = lm.generate_until(gen_requests([CONTEXT]))[0]
    ids = torch.tensor([lm.tok_encode(CONTEXT)])
    cache = KVPCache(lm.model, method="knorm", budget=8)
    out = lm.model.generate(
        ids, **{cache_kwarg(lm.model): cache}, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    assert got == lm.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split("\n\n")[0]


def test_generate_until_split_marker(tiny_dir):
    lm = make_lm(KVPLM, tiny_dir, method="knorm", budget=8, sink_tokens=2, window_tokens=2, batch_size=2)
    got = lm.generate_until(gen_requests([HEAD + SPLIT_MARKER + QUESTION]))[0]
    # By hand, the old protocol: compress the head, append the question one token at a time
    # (a single-token forward never evicts), decode.
    head_ids, full_ids = torch.tensor([lm.tok_encode(HEAD)]), torch.tensor([lm.tok_encode(CONTEXT)])
    assert torch.equal(full_ids[:, : head_ids.shape[1]], head_ids)
    cache = KVPCache(lm.model, method="knorm", budget=8, sink_tokens=2, window_tokens=2)
    forward_tokens(lm.model, cache, head_ids)
    assert cache.evicting_layers[0].physical_length() == 8
    for token in full_ids[0, head_ids.shape[1] : -1]:
        forward_tokens(lm.model, cache, token.view(1, 1))
    assert cache.evicting_layers[0].physical_length() == 8 + full_ids.shape[1] - 1 - head_ids.shape[1]
    out = lm.model.generate(
        full_ids, **{cache_kwarg(lm.model): cache}, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    assert got == lm.tokenizer.decode(out[0, full_ids.shape[1] :], skip_special_tokens=True).split("\n\n")[0]
    # Left-padded batch (same question, shorter head): the same answer as alone.
    batch = lm.generate_until(
        gen_requests([HEAD + SPLIT_MARKER + QUESTION, HEAD[:50] + SPLIT_MARKER + QUESTION])
    )
    assert batch[0] == got
    assert batch[1] == lm.generate_until(gen_requests([HEAD[:50] + SPLIT_MARKER + QUESTION]))[0]
    # Full budget: stock hf on the unmarked text.
    full = make_lm(KVPLM, tiny_dir, budget=1.0).generate_until(gen_requests([HEAD + SPLIT_MARKER + QUESTION]))
    assert full == make_lm(HFLM, tiny_dir).generate_until(gen_requests([CONTEXT]))


def test_max_cache_tokens_bounds_the_answer(tiny_dir, monkeypatch):
    lm = make_lm(
        KVPLM,
        tiny_dir,
        method="knorm",
        budget=8,
        sink_tokens=2,
        window_tokens=2,
        max_cache_tokens=6,
        evict_every=2,
    )
    assert lm.get_model_info()["kvp"]["max_cache_tokens"] == 6
    caches = []
    new_cache = lm.new_cache
    monkeypatch.setattr(lm, "new_cache", lambda **kw: caches.append(new_cache(**kw)) or caches[-1])
    got = lm.generate_until(gen_requests([CONTEXT]))[0]
    assert caches[0].evicting_layers[0].physical_length() <= 6 + 2
    # the same as generate with the same cache built by hand
    ids = torch.tensor([lm.tok_encode(CONTEXT)])
    cache = KVPCache(lm.model, budget=8, sink_tokens=2, window_tokens=2, max_cache_tokens=6, evict_every=2)
    out = lm.model.generate(
        ids, **{cache_kwarg(lm.model): cache}, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    assert got == lm.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split("\n\n")[0]
    with pytest.raises(ValueError, match="max_cache_tokens"):
        make_lm(KVPLM, tiny_dir, max_cache_tokens=3)


def test_allocation_model_arg(tiny_dir):
    lm = make_lm(KVPLM, tiny_dir, method="snapkv", budget=0.3, allocation="head", min_per_head=3)
    assert lm.get_model_info()["kvp"]["allocation"] == "head"
    cache = lm.new_cache()
    assert (cache.settings.allocation, cache.settings.min_per_head) == ("head", 3)
    got = lm.generate_until(gen_requests([HEAD + SPLIT_MARKER + QUESTION]))[0]
    assert isinstance(got, str)
    with pytest.raises(ValueError, match="not comparable across heads"):
        make_lm(KVPLM, tiny_dir, method="knorm", allocation="head")
    with pytest.raises(ValueError, match="allocation must be one of"):
        make_lm(KVPLM, tiny_dir, method="snapkv", allocation="global")


def test_split_at_marker():
    assert split_at_marker("no marker") is None
    assert split_at_marker(f"a{SPLIT_MARKER}b{SPLIT_MARKER}c") == ("ab", "abc")


def test_model_args(tiny_dir):
    lm = make_lm(KVPLM, tiny_dir, method="snapkv", method_options='{"window_size": 8}', option_kernel_size=3)
    assert lm.kvp_options == {"window_size": 8, "kernel_size": 3}
    cache = lm.new_cache()
    assert (cache.settings.scorer.window_size, cache.settings.scorer.kernel_size) == (8, 3)
    assert lm.get_model_info()["kvp"]["method"] == "snapkv"
    with pytest.raises(ValueError, match="Unknown method"):
        KVPLM(pretrained=tiny_dir, method="nope")
    with pytest.raises(TypeError, match="Unknown option"):
        KVPLM(pretrained=tiny_dir, method="knorm", option_window_size=3)
    with pytest.raises(ValueError, match="budget"):
        KVPLM(pretrained=tiny_dir, budget=0)
    with pytest.raises(ValueError, match="JSON object"):
        KVPLM(pretrained=tiny_dir, method_options="[1]")
    with pytest.raises(ValueError, match="method 'kvp'"):
        KVPLM(pretrained=tiny_dir, method="knorm", policy="anything")


def test_simple_evaluate_with_a_model_object(tiny_dir, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    task_dir = write_local_task(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    results = {}
    for budget in (1.0, 4):
        lm = KVPLM(pretrained=model, tokenizer=tokenizer, budget=budget, method="knorm")
        out = simple_evaluate(
            model=lm,
            tasks=["kvp_local_mc"],
            task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
            log_samples=True,
        )
        results[budget] = {
            **out["results"]["kvp_local_mc"],
            "resps": out["samples"]["kvp_local_mc"][0]["resps"],
        }
    hf = simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer),
        tasks=["kvp_local_mc"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
    )
    hf_results = {**hf["results"]["kvp_local_mc"], "resps": hf["samples"]["kvp_local_mc"][0]["resps"]}
    assert results[1.0]["acc,none"] == hf_results["acc,none"]
    assert_same_scores(
        [tuple(r) for resp in results[1.0]["resps"] for r in resp],
        [tuple(r) for resp in hf_results["resps"] for r in resp],
    )
    assert results[4]["resps"] != hf_results["resps"]  # budget 4 evicted something


def write_local_task(tmp_path):
    rows = [{"context": CONTEXT * (1 + i % 2), "choices": CHOICES, "label": i % 4} for i in range(6)]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "kvp_local_mc.yaml").write_text(
        "task: kvp_local_mc\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    return tmp_path


def test_cli_entry_point(tiny_dir, tmp_path):
    task_dir = write_local_task(tmp_path)
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-c",
        "import sys; from kvp_cache.integrations.lm_eval import main; sys.argv[0] = 'kvp-lm-eval'; main()",
        "--model",
        "kvp",
        "--model_args",
        json.dumps(
            {"pretrained": tiny_dir, "method": "snapkv", "budget": 8, "method_options": {"window_size": 4}}
        ),
        "--tasks",
        "kvp_local_mc",
        "--include_path",
        str(task_dir),
        "--device",
        "cpu",
        "--output_path",
        str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    assert "acc,none" in results["results"]["kvp_local_mc"]
    assert results["config"]["model"] == "kvp"
    # The k=v form, as lm-eval parses it, with a method option as an option_ key.
    lm = KVPLM.create_from_arg_string(
        f"pretrained={tiny_dir},method=snapkv,budget=8,option_window_size=4", {"device": "cpu"}
    )
    assert (lm.kvp_budget, lm.kvp_options) == (8, {"window_size": 4})


@pytest.fixture
def registered_tiny(tiny_dir, tmp_path, monkeypatch):
    """A registered offline name whose converted checkpoint (under ``$KVP_CACHE_HOME``) is the tiny model.

    It carries SmolLM2's tokenizer, so SmolLM2's tokenizer check applies to it unchanged.
    """
    monkeypatch.setenv("KVP_CACHE_HOME", str(tmp_path / "kvp_home"))
    (tmp_path / "kvp_home").mkdir()
    (tmp_path / "kvp_home" / "tiny-llama").symlink_to(tiny_dir)
    monkeypatch.setitem(MODELS, "tiny", dataclasses.replace(MODELS["smollm2"], model_id="test/tiny-llama"))
    return "tiny"


def test_pretrained_takes_a_registered_name(registered_tiny, tiny_dir):
    lm = make_lm(KVPLM, registered_tiny, method="knorm", budget=8)
    assert lm.model.config.name_or_path == "test/tiny-llama"  # as load_model records it
    assert lm.pretrained == "tiny"
    requests = gen_requests([CONTEXT])
    assert lm.generate_until(requests) == make_lm(KVPLM, tiny_dir, method="knorm", budget=8).generate_until(
        requests
    )
    assert lm.loglikelihood(ll_requests()) == make_lm(KVPLM, tiny_dir, budget=8).loglikelihood(ll_requests())


def test_registered_name_checks_its_tokenizer(registered_tiny, monkeypatch):
    monkeypatch.setitem(
        MODELS, registered_tiny, dataclasses.replace(MODELS[registered_tiny], probe_ids=(1, 2))
    )
    with pytest.raises(RuntimeError, match="converts the GGUF tokenizer wrongly"):
        make_lm(KVPLM, registered_tiny)


def test_cli_ruler_task_with_a_registered_name(registered_tiny, tiny_dir, tmp_path, monkeypatch):
    """``pretrained=<name>`` reaches both the model and the RULER data (which sizes prompts with its
    tokenizer); the results name the model, not the local checkpoint."""
    from kvp_cache.integrations.lm_eval import main

    out = tmp_path / "out"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "kvp-lm-eval",
            "--model",
            "kvp",
            "--model_args",
            f"pretrained={registered_tiny},budget=0.5,attn_implementation=eager",
            "--tasks",
            "kvp_ruler_niah_single_qin",
            "--include_path",
            str(TASKS_DIR),
            "--metadata",
            '{"max_seq_lengths": [1024], "num_samples": 1}',
            "--gen_kwargs",
            "max_gen_toks=4",
            "--device",
            "cpu",
            "--output_path",
            str(out),
        ],
    )
    main()
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--apply_chat_template"])
    with pytest.raises(ValueError, match="run them without --apply_chat_template"):
        main()
    (path,) = out.rglob("results_*.json")
    text = path.read_text()
    results = json.loads(text)
    assert results["model_name"] == registered_tiny
    provenance = results["config"]["provenance"]  # ours, with lm-eval's own config
    assert provenance["model"] == registered_tiny and provenance["git_commit"]
    assert provenance["command"].startswith("kvp-lm-eval ")  # lm-eval adds its subcommand after the program
    assert "--model_args pretrained=tiny," in provenance["command"]
    assert "--include_path eval/tasks " in provenance["command"]
    assert results["n-samples"]["kvp_ruler_niah_single_qin"]["effective"] == 1
    assert results["results"]["kvp_ruler_niah_single_qin"]["1024,none"] in (0.0, 1.0)
    assert str(tmp_path) not in text and tiny_dir not in text


def test_chat_template_is_not_applied_twice(tiny_dir):
    lm = make_lm(KVPLM, tiny_dir)
    plain = [{"role": "user", "content": CONTEXT}]
    expected = make_lm(HFLM, tiny_dir).apply_chat_template(plain)
    assert lm.apply_chat_template(plain) == expected and CONTEXT in expected
    templated = [{"role": "user", "content": expected + SPLIT_MARKER + "Answer:"}]
    with pytest.raises(ValueError, match="already holds the model's chat template"):
        lm.apply_chat_template(templated)


def test_prefill_and_continuation_equal_one_forward(tiny_dir):
    """The property the full-budget equality rests on, checked on the cache API directly."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager")
    ids = torch.randint(5, 1000, (1, 40))
    with torch.no_grad():
        whole = model(ids).logits
        cache = KVPCache(model, method="knorm", budget=1.0)
        first = forward_tokens(model, cache, ids[:, :30], logits_to_keep=1)
        rest = forward_tokens(model, cache, ids[:, 30:])
    torch.testing.assert_close(torch.cat([first, rest], 1), whole[:, 29:], rtol=1e-5, atol=1e-5)
