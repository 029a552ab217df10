"""KVPolicy: the batched agents against a per-head reference, saving/loading, model card, Hub, scorer."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from conftest import tiny_model
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

import kvp_cache.policy_loading as policy_loading
from kvp_cache import KVPCache, available_methods, make_scorer
from kvp_cache.agents import HeadAgents
from kvp_cache.policy import KVPolicy, load_policy, shipped_policies

SIZES = dict(hidden_dim=8, pos_dim=4, max_positions=12, num_mlp_layers=2)


def random_agents(strategy: str = "clamp", num_mlp_layers: int = 2, seed: int = 0) -> HeadAgents:
    """Agents with every parameter random (LayerNorm affines included), so no term is trivially 1 or 0."""
    torch.manual_seed(seed)
    agents = HeadAgents(3, 16, 8, 4, 12, num_mlp_layers, strategy)
    for parameter in agents.parameters():
        torch.nn.init.normal_(parameter)
    return agents


def padded_inputs(lengths: list[int], seq: int, seed: int = 1):
    """Left-padded keys/values ``[batch, 3, seq, 16]`` and positions (-1 on padding)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(len(lengths), 3, seq, 16, generator=generator)
    values = torch.randn(len(lengths), 3, seq, 16, generator=generator)
    positions = torch.full((len(lengths), seq), -1)
    for row, n in enumerate(lengths):
        positions[row, seq - n :] = torch.arange(n)
    return keys, values, positions


def tiny_policy(model, seed: int = 0, **options) -> KVPolicy:
    torch.manual_seed(seed)
    return KVPolicy.for_model(model, **{**SIZES, **options})


# ---- the agents -------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["clamp", "scale"])
@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "inference"])
@pytest.mark.parametrize("num_mlp_layers", [1, 2, 3])
def test_agents_match_per_head_reference(num_mlp_layers, grad, strategy):
    """Both paths: training keeps every intermediate, inference overwrites them in place."""
    agents = random_agents(strategy, num_mlp_layers=num_mlp_layers)
    keys, values, positions = padded_inputs([10, 7, 1], seq=10)
    inputs = [t.clone() for t in (keys, values, positions, *agents.parameters())]
    with torch.set_grad_enabled(grad):
        scores = agents(keys, values, positions)
    after = (keys, values, positions, *agents.parameters())
    assert all(torch.equal(a, b) for a, b in zip(inputs, after, strict=True))
    expected = agents.reference_forward(keys, values, positions)
    assert scores.dtype == torch.float32 and scores.shape == (3, 3, 10)
    assert torch.equal(scores.isinf(), positions[:, None, :].expand(-1, 3, -1) < 0)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strategy", ["clamp", "scale", "recency"])
def test_positions_past_the_table_follow_the_strategy(strategy):
    agents = random_agents(strategy)
    keys, values, positions = padded_inputs([30, 12, 5], seq=30)  # 30 > max_positions = 12
    torch.testing.assert_close(
        agents(keys, values, positions),
        agents.reference_forward(keys, values, positions),
        rtol=1e-4,
        atol=1e-4,
    )


def test_scale_equals_clamp_within_the_table_and_spreads_longer_rows():
    clamp, scale = random_agents("clamp"), random_agents("scale")
    keys, values, positions = padded_inputs([12, 6], seq=12)
    assert torch.equal(clamp(keys, values, positions), scale(keys, values, positions))
    # Beyond the table, identical tokens at different positions score alike under clamp only.
    same = torch.randn(1, 3, 1, 16).expand(1, 3, 30, 16)
    positions = torch.arange(30)[None]
    tail_clamp = clamp(same, same, positions)[..., 11:]
    tail_scale = scale(same, same, positions)[..., 11:]
    assert torch.allclose(tail_clamp, tail_clamp[..., :1].expand_as(tail_clamp))
    assert not torch.allclose(tail_scale, tail_scale[..., :1].expand_as(tail_scale))


def test_recency_reads_the_same_row_for_the_same_distance_at_every_length():
    agents = random_agents("recency")
    same = torch.randn(1, 3, 1, 16)
    short = agents(same.expand(1, 3, 10, 16), same.expand(1, 3, 10, 16), torch.arange(10)[None])
    long = agents(same.expand(1, 3, 300, 16), same.expand(1, 3, 300, 16), torch.arange(300)[None])
    # The last ten tokens of either row are at distances 9..0 from the row's end.
    torch.testing.assert_close(short, long[..., -10:], rtol=1e-5, atol=1e-5)
    rows = agents.table_positions(torch.tensor([[0, 1, 2, 3]]))
    assert torch.allclose(rows, torch.log2(torch.tensor([[4.0, 3.0, 2.0, 1.0]])) * 11 / 16)
    assert not torch.allclose(long, long[..., :1].expand_as(long))


@pytest.mark.parametrize("strategy", ["clamp", "scale", "recency"])
def test_rows_past_the_trained_length_never_change_a_score(strategy):
    keys, values, positions = padded_inputs([30, 9, 4], seq=30)
    trained, scrambled = random_agents(strategy), random_agents(strategy)
    trained.trained_length = scrambled.trained_length = 8  # the table has 12 rows
    top = math.ceil(trained.last_trained_row())
    assert top < 11
    with torch.no_grad():
        scrambled.position_table[:, top + 1 :] = torch.randn_like(scrambled.position_table[:, top + 1 :])
    torch.testing.assert_close(trained(keys, values, positions), scrambled(keys, values, positions))
    torch.testing.assert_close(
        trained(keys, values, positions),
        trained.reference_forward(keys, values, positions),
        rtol=1e-4,
        atol=1e-4,
    )
    # Without the training length those rows are read, and the scores change.
    trained.trained_length = scrambled.trained_length = None
    assert not torch.allclose(trained(keys, values, positions), scrambled(keys, values, positions))


@pytest.mark.parametrize("strategy", ["clamp", "scale", "recency"])
def test_prompts_within_the_trained_length_score_as_without_it(strategy):
    agents = random_agents(strategy)
    keys, values, positions = padded_inputs([8, 5], seq=8)
    unknown = agents(keys, values, positions)
    agents.trained_length = 8
    torch.testing.assert_close(agents(keys, values, positions), unknown, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["scale", "recency"])
def test_batched_rows_score_like_single_rows(strategy):
    agents = random_agents(strategy)
    keys, values, positions = padded_inputs([20, 9], seq=20)
    batched = agents(keys, values, positions)
    for row, n in enumerate([20, 9]):
        alone = agents(
            keys[row : row + 1, :, -n:], values[row : row + 1, :, -n:], positions[row : row + 1, -n:]
        )
        torch.testing.assert_close(batched[row : row + 1, :, -n:], alone, rtol=1e-5, atol=1e-5)


def test_half_precision_inputs_give_float32_scores():
    agents = random_agents()
    keys, values, positions = padded_inputs([6], seq=6)
    scores = agents(keys.bfloat16(), values.bfloat16(), positions)
    assert scores.dtype == torch.float32 and agents.position_table.dtype == torch.float32
    expected = agents(keys.bfloat16().float(), values.bfloat16().float(), positions)
    torch.testing.assert_close(scores, expected)


def test_every_parameter_gets_a_gradient():
    agents = random_agents("scale")
    keys, values, positions = padded_inputs([20, 15], seq=20)
    scores = agents(keys, values, positions)
    scores[scores.isfinite()].square().sum().backward()
    for name, parameter in agents.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_dim=0), "hidden_dim must be an int >= 1"),
        (dict(max_positions=2.5), "max_positions must be an int >= 1"),
        (dict(num_mlp_layers=0), "num_mlp_layers must be an int >= 1"),
        (dict(position_strategy="rope"), "position_strategy must be one of"),
        (dict(trained_length=0), "trained_length must be an int >= 1"),
        (dict(num_layers=0), "num_layers must be an int >= 1"),
        (dict(training=[1]), "training must be a dict"),
        (
            dict(training={"evaluation": {"budgets": [1, 2], "methods": {"kvp": [0.1]}}}),
            "one value per budget",
        ),
    ],
)
def test_bad_options_are_refused(change, message):
    options = dict(num_layers=2, num_kv_heads=2, head_dim=16, **SIZES) | change
    with pytest.raises(ValueError, match=message):
        KVPolicy(**options)


def test_bad_inputs_are_refused(llama):
    policy = tiny_policy(llama)
    keys, positions = torch.randn(1, 2, 5, 16), torch.arange(5)[None]
    with pytest.raises(ValueError, match=r"layer_idx must be one of the policy's layer_indices \[0, 1\]"):
        policy(2, keys, keys, positions)
    with pytest.raises(ValueError, match=r"keys must be \[batch, 2, seq, 16\]"):
        policy(0, torch.randn(1, 3, 5, 16), torch.randn(1, 3, 5, 16), positions)
    with pytest.raises(ValueError, match="positions must be"):
        policy(0, keys, keys, positions[:, :4])
    with pytest.raises(ValueError, match="position_strategy must be one of"):
        policy.position_strategy = "nope"


# ---- shape checks against models ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, layers, head_dim, evicting",
    [("llama", 2, 16, [0, 1]), ("qwen3", 2, 16, [0, 1]), ("gemma3", 4, 16, [1, 3])],
)
def test_for_model_reads_the_decoder_shape(kind, layers, head_dim, evicting):
    model = tiny_model(kind)
    model.config.name_or_path = "someone/tiny-" + kind
    policy = KVPolicy.for_model(model, **SIZES)
    assert (policy.num_layers, policy.num_kv_heads, policy.head_dim) == (layers, 2, head_dim)
    assert policy.layer_indices == evicting and len(policy.layers) == len(evicting)
    assert policy.base_model == "someone/tiny-" + kind
    assert KVPolicy.for_model(model.config, base_model="x/y", **SIZES).base_model == "x/y"
    policy.check_compatible(model.config)
    with pytest.raises(TypeError, match="num_layers"):
        KVPolicy.for_model(model, num_layers=3)


def test_check_compatible_names_each_mismatch(llama):
    policy = KVPolicy(num_layers=3, num_kv_heads=4, head_dim=8, base_model="a/model", **SIZES)
    llama.config.name_or_path = "b/model"
    with pytest.raises(ValueError) as error:
        policy.check_compatible(llama.config)
    for expected in ("num_layers: policy has 3, model has 2", "num_kv_heads: policy has 4, model has 2"):
        assert expected in str(error.value)
    assert "head_dim: policy has 8, model has 16" in str(error.value)
    assert "trained for 'a/model', model is 'b/model'" in str(error.value)
    same_shape = tiny_policy(llama, base_model="a/model")
    with pytest.raises(ValueError, match="base model"):
        same_shape.check_compatible(llama)
    same_shape.check_compatible(llama, check_base_model=False)
    llama.config.name_or_path = ""  # unknown: nothing to compare
    same_shape.check_compatible(llama.config)


# ---- saving and loading ------------------------------------------------------------------------


TRAINING = {
    "data": "64 Paul Graham essay windows of 1024 tokens",
    "datasets": ["someone/pg-essays"],
    "steps": 300,
    "command": "python -m train rl --steps 300",
    "seed": 0,
    "evaluation": {
        "data": "16 held-out windows",
        "budgets": [64, 256],
        "methods": {"kvp": [0.125, 0.03125], "knorm": [0.5, 0.25]},
        "accuracy_task": "RULER niah",
        "accuracy": {"kvp": [0.5, 0.875]},
    },
}


def test_round_trip_through_a_directory(llama, tmp_path):
    policy = tiny_policy(
        llama, base_model="someone/tiny-llama", training=TRAINING, position_strategy="scale", trained_length=9
    )
    policy.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # others can read what they can read
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_layers"] == 2 and config["num_kv_heads"] == 2 and config["head_dim"] == 16
    assert config["hidden_dim"] == 8 and config["position_strategy"] == "scale"
    assert config["base_model"] == "someone/tiny-llama" and config["training"] == TRAINING
    loaded = load_policy(tmp_path)
    assert not loaded.training and loaded.position_strategy == "scale" and loaded.training_info == TRAINING
    assert config["trained_length"] == loaded.trained_length == 9
    assert "prompts of up to 9 tokens" in (tmp_path / "README.md").read_text()
    keys, values, positions = padded_inputs([20, 13], seq=20)
    keys, values = keys[:, :2], values[:, :2]
    for layer in range(2):
        assert torch.equal(loaded(layer, keys, values, positions), policy(layer, keys, values, positions))
    assert torch.equal(
        KVPolicy.from_pretrained(str(tmp_path))(0, keys, values, positions),
        loaded(0, keys, values, positions),
    )


def test_saving_again_rewrites_config_and_card(llama, tmp_path):
    tiny_policy(llama, training={"steps": 1}).save_pretrained(tmp_path)
    policy = tiny_policy(llama, seed=1, training={"steps": 2})
    policy.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["training"] == {"steps": 2}
    assert "- steps: 2" in (tmp_path / "README.md").read_text()
    with pytest.raises(TypeError, match="config"):
        policy.save_pretrained(tmp_path, config={"num_layers": 9})


def test_model_card(llama, tmp_path):
    tiny_policy(llama, base_model="someone/tiny-llama", training=TRAINING).save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.library_name == "kvp_cache" and card.data.license == "apache-2.0"
    assert card.data.base_model == "someone/tiny-llama" and card.data.datasets == ["someone/pg-essays"]
    assert {"kv-cache-compression", "kvp"} <= set(card.data.tags)
    text = card.text
    assert 'KVPCache.from_pretrained("path/to/this/policy", model=model' in text
    assert 'AutoModelForCausalLM.from_pretrained("someone/tiny-llama")' in text
    assert "- data: 64 Paul Graham essay windows of 1024 tokens" in text
    assert "- steps: 300" in text and "- command: `python -m train rl --steps 300`" in text
    assert "- seed: 0" in text and "On 16 held-out windows." in text
    assert "| method | 64 | 256 |" in text
    assert "| kvp | 0.125 | 0.03125 |" in text and "| knorm | 0.5 | 0.25 |" in text
    assert "Accuracy on RULER niah" in text and "| kvp | 0.5 | 0.875 |" in text


def test_age_decay_is_saved_loaded_shown_and_used_by_the_cache(llama, tmp_path):
    """A policy's ``age_decay`` travels in config.json; ``KVPCache`` takes it unless told otherwise."""
    from kvp_cache import KVPCache

    policy = tiny_policy(llama)
    assert (
        policy.age_decay == 0.0
        and "age_decay" not in (_saved(llama, tmp_path / "plain") / "README.md").read_text()
    )
    policy.age_decay = 0.5
    policy.save_pretrained(tmp_path / "aged")
    config = json.loads((tmp_path / "aged" / "config.json").read_text())
    assert config["age_decay"] == 0.5
    assert "- age_decay 0.5: when the cache evicts again" in (tmp_path / "aged" / "README.md").read_text()
    loaded = load_policy(tmp_path / "aged")
    assert loaded.age_decay == 0.5
    assert KVPCache.from_pretrained(tmp_path / "aged", model=llama).settings.scorer.age_decay == 0.5
    assert KVPCache.from_pretrained(loaded, model=llama, age_decay=0).settings.scorer.age_decay == 0.0
    assert KVPCache.from_pretrained(loaded, model=llama, age_decay=2).settings.scorer.age_decay == 2.0
    # A config.json written before the option holds none: no decay, as its policy was run.
    (tmp_path / "aged" / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k != "age_decay"})
    )
    assert load_policy(tmp_path / "aged").age_decay == 0.0
    (tmp_path / "aged" / "config.json").write_text(json.dumps(config | {"age_decay": -1}))
    with pytest.raises(ValueError, match=r"age_decay must be a finite number >= 0 \(0: no decay\), got -1"):
        load_policy(tmp_path / "aged")


def test_card_tables_put_the_best_method_first():
    from kvp_cache.policy_card import evaluation_table

    rows = {"kvp": [0.25, 0.04], "random": [0.5, 0.3], "oracle": [0.2, 0.02]}

    def order(table: str) -> list[str]:
        return [line.split("|")[1].strip() for line in table.splitlines()[2:]]

    assert order(evaluation_table([0.1, 0.25], rows)) == ["oracle", "kvp", "random"]
    assert order(evaluation_table([0.1, 0.25], rows, lower_is_better=False)) == ["random", "kvp", "oracle"]


def test_card_without_training_says_so(llama, tmp_path):
    tiny_policy(llama).save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    assert (
        card.data.base_model is None
        and "No training record" in card.text
        and "## Evaluation" not in card.text
    )


def _saved(llama, path: Path) -> Path:
    tiny_policy(llama).save_pretrained(path)
    return path


def test_extra_key_is_refused(llama, tmp_path):
    path = _saved(llama, tmp_path)
    state = load_file(path / "model.safetensors")
    state["layers.2.out.bias"] = torch.zeros(2, 1)
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected keys: layers\.2\.out\.bias"):
        load_policy(path)


def test_missing_key_is_refused(llama, tmp_path):
    path = _saved(llama, tmp_path)
    state = load_file(path / "model.safetensors")
    del state["layers.1.position_table"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing keys: layers\.1\.position_table"):
        load_policy(path)


def test_weights_of_another_size_are_refused(llama, tmp_path):
    path = _saved(llama, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"hidden_dim": 6}))
    with pytest.raises(ValueError, match="shape mismatches: layers.0.key_norm.bias"):
        load_policy(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c | {"use_queries": True}, r"unknown keys \['use_queries'\]"),
        (lambda c: {k: v for k, v in c.items() if k != "pos_dim"}, r"missing keys \['pos_dim'\]"),
    ],
)
def test_config_keys_are_checked(llama, tmp_path, edit, message):
    path = _saved(llama, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(edit(config)))
    with pytest.raises(ValueError, match=message):
        load_policy(path)


def test_pickle_only_directory_is_refused_without_unpickling(llama, tmp_path, monkeypatch):
    path = _saved(llama, tmp_path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not read")
    (path / "extra.pt").write_bytes(b"not read")

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(ValueError, match=r"only pickle checkpoints \(extra.pt, pytorch_model.bin\)"):
        load_policy(path)


def test_corrupt_or_incomplete_directories_are_refused(llama, tmp_path):
    path = _saved(llama, tmp_path / "a")
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_policy(path)
    path = _saved(llama, tmp_path / "b")
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        load_policy(path)
    with pytest.raises(ValueError, match="is a file"):
        load_policy(path / "model.safetensors")


# ---- name resolution: shipped, local, Hub --------------------------------------------------------


@pytest.fixture
def shipped_dir(tmp_path, monkeypatch, llama):
    """A temporary kvp_cache/policies/ holding one complete policy 'tiny' and one without weights."""
    root = tmp_path / "policies"
    tiny_policy(llama, seed=5).save_pretrained(root / "tiny")
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{}")
    monkeypatch.setattr(policy_loading, "POLICIES_DIR", root)
    return root


def test_shipped_names_come_first(shipped_dir, tmp_path, monkeypatch, llama):
    assert shipped_policies() == ["tiny"]
    work = tmp_path / "work"
    tiny_policy(llama, seed=6).save_pretrained(work / "tiny")  # a local dir with the shipped name
    monkeypatch.chdir(work)
    keys, positions = torch.randn(1, 2, 4, 16), torch.arange(4)[None]
    shipped = tiny_policy(llama, seed=5)(0, keys, keys, positions)
    assert torch.equal(load_policy("tiny")(0, keys, keys, positions), shipped)
    local = tiny_policy(llama, seed=6)(0, keys, keys, positions)
    assert torch.equal(load_policy(Path("tiny"))(0, keys, keys, positions), local)
    assert torch.equal(load_policy("./tiny")(0, keys, keys, positions), local)


def test_unknown_names_list_the_shipped_policies(shipped_dir):
    with pytest.raises(ValueError, match=r"Unknown policy 'nope'.*\(tiny\)"):
        load_policy("nope")
    with pytest.raises(ValueError, match="does not exist"):
        load_policy("./no/such/dir")


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty HF cache with offline mode on: no request can leave the machine."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_offline_uncached_repo_gives_a_clear_error(offline_hub):
    with pytest.raises(
        ValueError, match=r"'someone/not-cached'.*not in the local Hugging Face cache.*HF_HUB_OFFLINE"
    ):
        load_policy("someone/not-cached")


def test_offline_cached_repo_loads(offline_hub, llama, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_hub / "models--someone--tiny-policy"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    policy = tiny_policy(llama, seed=3)
    policy.save_pretrained(repo / "snapshots" / commit)
    keys, positions = torch.randn(1, 2, 4, 16), torch.arange(4)[None]
    loaded = load_policy("someone/tiny-policy")
    assert torch.equal(loaded(1, keys, keys, positions), policy(1, keys, keys, positions))


def test_hub_repo_without_safetensors_is_refused(llama, tmp_path, monkeypatch):
    config = _saved(llama, tmp_path) / "config.json"

    def download(repo_id, filename, **kwargs):
        if filename == "config.json":
            return str(config)
        raise huggingface_hub.errors.EntryNotFoundError(f"{filename} is not in {repo_id}")

    monkeypatch.setattr(policy_loading, "hf_hub_download", download)
    with pytest.raises(ValueError, match="has no model.safetensors.*never pickle checkpoints"):
        load_policy("someone/pickle-only")


def test_push_to_hub_uploads_weights_config_and_card(llama, tmp_path, monkeypatch):
    uploaded: dict = {}

    def create_repo(self, repo_id, **kwargs):
        uploaded["created"] = repo_id
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, *, repo_id, folder_path, repo_type, **kwargs):
        uploaded.update(
            repo_id=repo_id, repo_type=repo_type, files=sorted(p.name for p in Path(folder_path).iterdir())
        )
        shutil.copytree(folder_path, tmp_path / "uploaded")
        return f"https://huggingface.co/{repo_id}/commit/abc"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    policy = tiny_policy(llama, base_model="someone/tiny-llama", training=TRAINING)
    url = policy.push_to_hub("someone/tiny-policy", token="not-a-token")
    assert url == "https://huggingface.co/someone/tiny-policy/commit/abc"
    assert uploaded["created"] == "someone/tiny-policy" and uploaded["repo_type"] == "model"
    assert uploaded["files"] == ["README.md", "config.json", "model.safetensors"]
    card = (tmp_path / "uploaded" / "README.md").read_text()
    assert 'KVPCache.from_pretrained("someone/tiny-policy", model=model' in card
    keys, positions = torch.randn(1, 2, 4, 16), torch.arange(4)[None]
    assert torch.equal(
        load_policy(tmp_path / "uploaded")(0, keys, keys, positions), policy(0, keys, keys, positions)
    )


# ---- the scorer and the cache ---------------------------------------------------------------------


def test_scorer_needs_a_policy(llama):
    assert "kvp" in available_methods()
    with pytest.raises(ValueError, match=r"method 'kvp' needs policy=\.\.\., use KVPCache.from_pretrained"):
        make_scorer("kvp")
    with pytest.raises(ValueError, match="needs policy"):
        KVPCache(llama, method="kvp")
    with pytest.raises(TypeError, match="KVPolicy"):
        make_scorer("kvp", policy=torch.nn.Linear(2, 2))


def test_a_policy_implies_the_learned_method(llama, tmp_path):
    policy = tiny_policy(llama, seed=2)
    policy.save_pretrained(tmp_path)
    cache = KVPCache(llama, policy=str(tmp_path), budget=0.5)
    assert (
        cache.method == "kvp"
        and cache.settings.scorer.policy.weights_sha256 == load_policy(tmp_path).weights_sha256
    )
    assert KVPCache(llama).method == "knorm"  # no policy: the default key/value-only method
    with pytest.raises(TypeError, match=r"policy= belongs to .*'kvp'.*not to method 'snapkv'"):
        KVPCache(llama, method="snapkv", policy=policy)


@pytest.mark.parametrize("source", ["object", "directory"])
def test_cache_keeps_the_policy_top_entries(llama, tmp_path, source):
    policy = tiny_policy(llama, seed=2)
    if source == "directory":
        policy.save_pretrained(tmp_path)
    budget, prompt = 7, torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    cache = KVPCache.from_pretrained(
        policy if source == "object" else str(tmp_path),
        model=llama,
        budget=budget,
        sink_tokens=0,
        window_tokens=0,
        track_positions=True,
    )
    full = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(prompt, cache=full)
        llama(prompt, attention_mask=torch.ones_like(prompt), cache=cache)
    positions = torch.arange(24)[None]
    for layer_idx, layer in enumerate(cache.evicting_layers):
        assert layer.keys.shape[-2] == budget
        scores = policy(layer_idx, full.layers[layer_idx].keys, full.layers[layer_idx].values, positions)
        expected = scores.topk(budget, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.positions, expected)


def test_generate_with_a_saved_policy(llama, tmp_path):
    tiny_policy(llama).save_pretrained(tmp_path)
    cache = KVPCache.from_pretrained(str(tmp_path), model=llama, budget=10)
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    output = llama.generate(
        prompt, attention_mask=torch.ones_like(prompt), cache=cache, max_new_tokens=5, do_sample=False
    )
    assert output.shape == (1, 45)
    # The prefill evicts to the budget; the 4 decoded tokens fed back are appended.
    assert all(layer.keys.shape[-2] == 10 + 4 for layer in cache.evicting_layers)
    assert cache.get_seq_length() == 44


def test_half_precision_model_keeps_float32_policy(tmp_path):
    model = tiny_model("llama").to(torch.bfloat16)
    policy = tiny_policy(model)
    cache = KVPCache.from_pretrained(policy, model=model, budget=6)
    prompt = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompt)
    mask[1, :5] = 0
    model.generate(prompt, attention_mask=mask, cache=cache, max_new_tokens=2, do_sample=False)
    assert policy.layers[0].position_table.dtype == torch.float32
    assert cache.evicting_layers[0].keys.dtype == torch.bfloat16


def test_policy_for_another_model_is_refused(llama):
    policy = tiny_policy(tiny_model("gemma3"))
    with pytest.raises(ValueError, match="num_layers: policy has 4, model has 2"):
        KVPCache.from_pretrained(policy, model=llama)
