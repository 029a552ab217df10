"""Every method on every available device and dtype against the masked reference (tests/reference.py).

CUDA cases exist only where a GPU does (run them there with ``pytest tests/test_device.py``); on a
CPU-only machine the bfloat16 cases still check that no scorer or cache step depends on float32.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from reference import check_generate_against_reference, ids
from test_cache import make_cache
from test_policy import tiny_policy

from kvp_cache import available_methods

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# bfloat16 keeps 8 bits of mantissa; the reference attends in float32, the model in bfloat16.
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("method", sorted(available_methods()))
def test_every_method_matches_reference_on_device_and_dtype(method, kind, dtype, device):
    model = tiny_model(kind, attn_implementation="sdpa").to(device=device, dtype=dtype)
    options = {"policy": tiny_policy(model)} if method == "kvp" else {}
    cache = make_cache(model, method, budget=0.4, **options)
    prompt = ids(length=50, seed=2).to(device)
    check_generate_against_reference(model, prompt, cache, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    for layer in cache.evicting_layers:
        assert layer.keys.device.type == device and layer.keys.dtype == dtype
        assert layer.positions.device.type == device
