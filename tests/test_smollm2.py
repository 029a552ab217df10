"""KVPCache on the real SmolLM2-135M-Instruct at about 2K tokens, against the reference."""

import pytest
import torch
from reference import ForwardRecorder, reference_logits
from transformers import AutoConfig

from kvp_cache import KVPCache
from kvp_cache.compat import cache_kwarg
from kvp_cache.models import MODELS, OfflineModel
from kvp_cache.ruler import chat_prompt, load_haystack, make_samples

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def needle_prompt(smollm2, prose_dir):
    model, tokenizer = smollm2
    sample = make_samples("niah_single", tokenizer, 2000, n=1, seed=3, haystack=load_haystack(prose_dir))[0]
    prefix, suffix = chat_prompt(sample, tokenizer, question_in_context=True)
    return sample, tokenizer(prefix + suffix, return_tensors="pt", add_special_tokens=False).input_ids


def check_against_reference(model, prompt, cache) -> None:
    """Greedy 4 tokens through ``cache``: their logits equal the masked reference's."""
    recorder = ForwardRecorder(model, cache)
    out = model.generate(
        prompt,
        **{cache_kwarg(model): cache},
        max_new_tokens=4,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    recorder.remove()
    logits = torch.stack(out.logits, 1).float()
    ref = reference_logits(model, out.sequences, recorder.snapshots)
    n = prompt.shape[1]
    torch.testing.assert_close(logits, ref[:, n - 1 : n + 3], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("method", ["knorm", "snapkv"])
@torch.no_grad()
def test_generate_matches_reference_at_2k_tokens(smollm2, needle_prompt, method):
    model, _ = smollm2
    _, prompt = needle_prompt
    n = prompt.shape[1]
    assert 1800 <= n <= 2300
    cache = KVPCache(model, method=method, budget=0.25, track_positions=True)
    check_against_reference(model, prompt, cache)
    assert cache.evicting_layers[0].keys.shape[-2] == -(-n // 4) + 3
    assert len(cache.evicting_layers) == 30


@pytest.mark.parametrize("allocation", ["head", "layer"])
@torch.no_grad()
def test_adaptive_shipped_policy_matches_reference_at_2k_tokens(smollm2, needle_prompt, allocation):
    model, _ = smollm2
    _, prompt = needle_prompt
    n = prompt.shape[1]
    cache = KVPCache.from_pretrained(
        "smollm2-135m-instruct", model=model, budget=0.1, allocation=allocation, track_positions=True
    )
    check_against_reference(model, prompt, cache)
    counts = [c for layer in cache.evicting_layers for c in layer.lengths]
    assert len(counts) == 90 and sum(counts) == 90 * (-(-n // 10) + 3)  # equal total to uniform's
    assert max(counts) > min(counts) + 10  # the policy really moved entries between heads


@torch.no_grad()
def test_full_budget_identical_to_dynamic_cache(smollm2, needle_prompt):
    model, tokenizer = smollm2
    sample, prompt = needle_prompt
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    out = model.generate(
        prompt,
        **{cache_kwarg(model): KVPCache(model, method="knorm", budget=1.0)},
        max_new_tokens=12,
        do_sample=False,
    )
    assert torch.equal(out, expected)
    # the needle is retrieved at 2K with the full cache, so the budget sweeps have something to lose
    assert sample.answers[0] in tokenizer.decode(expected[0, prompt.shape[1] :])


def test_a_conversion_that_loses_the_race_keeps_the_winners_copy(tmp_path, monkeypatch):
    """Two processes converting at once (torchrun ranks, parallel benchmark runs) used to share one
    staging directory, and the slower one crashed inside safetensors."""
    monkeypatch.setenv("KVP_CACHE_HOME", str(tmp_path))
    smollm2 = MODELS["smollm2"]
    check_tokenizer = OfflineModel.check_tokenizer
    rivals = []

    def rival_finishes_first(self, tokenizer):
        check_tokenizer(self, tokenizer)
        if not rivals:
            rivals.append(None)  # before the rival's conversion, which calls this hook again
            rivals[0] = self.converted_dir()  # a whole conversion while this one is half way

    monkeypatch.setattr(OfflineModel, "check_tokenizer", rival_finishes_first)
    target = smollm2.converted_dir()
    assert rivals == [target]
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no staging directory left
    assert AutoConfig.from_pretrained(target).num_hidden_layers == 30
