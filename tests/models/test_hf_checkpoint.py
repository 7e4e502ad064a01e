"""Hugging Face checkpoints written here (transformers' tensor names, every family and option) load and
serve through the paged store as an independent numpy forward computes; bad checkpoints fail whole."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from hf_fixtures import FAMILY_CONFIGS, random_tensors, tensor_shapes, write_checkpoint
from np_forward import forward
from ninfer_kv.models.generate import PagedGenerator
from ninfer_kv.models.hf import (
    CheckpointError,
    UnsupportedModelError,
    load_checkpoint,
    plan_checkpoint,
    read_header,
)

PROMPT_LEN = 70  # two pages, one 128-token prefill chunk
NEW = 3
TOL = 2e-3  # float32 model, K/V rounded to bf16 on both sides; observed ~2e-4


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(11).integers(0, 256, PROMPT_LEN).tolist()


# The checkpoint dtypes rotate over the families, so every cast (BF16, F16, F32 -> float32) is covered.
CASES = [("qwen3", "BF16", 1), ("qwen2", "F16", 2), ("llama", "F32", 1), ("mistral", "BF16", 3)]


@pytest.mark.parametrize("family, dtype, shards", CASES, ids=[c[0] for c in CASES])
def test_family_matches_the_numpy_forward(tmp_path, prompt, family, dtype, shards):
    cfg = FAMILY_CONFIGS[family]
    tensors = random_tensors(cfg, seed=5, dtype=dtype)
    write_checkpoint(tmp_path, cfg, tensors, shards=shards)
    model = load_checkpoint(tmp_path, dtype="float32")
    assert model.bytes_read == sum(a.nbytes for a in tensors.values())
    c = model.config
    assert c.qk_norm == (family == "qwen3") and c.tie_embeddings == (family == "qwen3")
    assert c.qkv_bias == (family in ("qwen2", "qwen3")) and c.o_bias == (family == "qwen3")
    assert c.mlp_bias == (family == "llama")
    assert (c.rope_scaling.kind if c.rope_scaling else None) == {"qwen3": "yarn", "qwen2": "linear", "llama": "llama3",
                                                                  "mistral": None}[family]
    assert "lm_head" not in model.params if family == "qwen3" else "lm_head" in model.params
    gen = PagedGenerator(model.params, c, max_context=256, max_batch=1, keep_logits=True)
    seq = gen.generate([prompt], max_new_tokens=NEW)[0]
    full = prompt + seq.generated[:-1]
    want = forward(tensors, cfg, full)[PROMPT_LEN - 1 :]
    got = np.stack(seq.logits)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    top2 = np.sort(want, axis=-1)[:, -2:]
    assert np.all(top2[:, 1] - top2[:, 0] > 10 * TOL), "a near tie: pick another seed"
    assert seq.generated == [int(x) for x in np.argmax(want, axis=-1)]


def test_bfloat16_serving_of_a_float32_checkpoint(tmp_path, prompt):
    cfg = FAMILY_CONFIGS["llama"]
    tensors = random_tensors(cfg, seed=6, dtype="F32")
    write_checkpoint(tmp_path, cfg, tensors)
    model = load_checkpoint(tmp_path, dtype="bfloat16")
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree_util.tree_leaves(model.params))
    gen = PagedGenerator(model.params, model.config, max_context=128, max_batch=1, keep_logits=True)
    seq = gen.generate([prompt], max_new_tokens=1)[0]
    want = forward(tensors, cfg, prompt)[-1]
    assert np.max(np.abs(seq.logits[0] - want)) < 0.25  # bfloat16 activations
    assert np.corrcoef(seq.logits[0], want)[0, 1] > 0.999


# -- bad checkpoints ---------------------------------------------------------------------------------


@pytest.fixture
def good(tmp_path):
    cfg = FAMILY_CONFIGS["qwen2"]
    return write_checkpoint(tmp_path / "ck", cfg, random_tensors(cfg, seed=1, dtype="BF16"))


def _edit_config(directory, **changes):
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


def _rewrite(directory, edit):
    from ninfer_kv.models.hf.safetensors_io import tensor

    header = read_header(directory / "model.safetensors")
    tensors = {n: np.array(tensor(t)) for n, t in header.tensors.items()}
    edit(tensors)
    write_checkpoint(directory, json.loads((directory / "config.json").read_text()), tensors)


def test_missing_tensor_is_named(good):
    _rewrite(good, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.bias' is missing"):
        load_checkpoint(good)


def test_wrong_shape_is_named(good):
    _rewrite(good, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", np.zeros((192, 64), np.float32)))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*\(192, 64\).*\(192, 128\)"):
        load_checkpoint(good)


def test_unexpected_tensor_and_bad_dtype_are_named(good, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(good, other)
    _rewrite(good, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.bias", np.zeros(128, np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"):
        load_checkpoint(good)
    _rewrite(other, lambda t: t.__setitem__("model.norm.weight", np.zeros(128, np.int32)))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*dtype I32"):
        load_checkpoint(other)


def test_truncated_file_names_the_tensor_it_cuts(good):
    path = good / "model.safetensors"
    header = read_header(path)
    last = max(header.tensors.values(), key=lambda t: t.end)
    with open(path, "r+b") as f:
        f.truncate(last.end - 10)
    with pytest.raises(CheckpointError, match=rf"{last.name}.*truncated"):
        load_checkpoint(good)


def test_unknown_architecture_and_options_are_refused_before_any_weight(good):
    (good / "model.safetensors").write_bytes(b"not a safetensors file")  # never opened: the config is refused first
    cases = [
        (dict(architectures=["GPT2LMHeadModel"]), r"architectures=\['GPT2LMHeadModel'\].*Qwen3ForCausalLM"),
        (dict(architectures=["Qwen3MoeForCausalLM"]), r"Qwen3MoeForCausalLM.*mixture-of-experts"),
        (dict(num_experts=8), r"num_experts=8.*mixture-of-experts"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu'"),
        (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0\.5"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_type='dynamic'"),
        (dict(use_sliding_window=True, sliding_window=1024, max_window_layers=0), r"sliding_window=1024.*max_context=4096"),
        (dict(quantization_config={"quant_method": "gptq"}), r"quant_method='gptq'"),
    ]
    for change, match in cases:
        original = (good / "config.json").read_text()
        _edit_config(good, **change)
        with pytest.raises(UnsupportedModelError, match=match):
            load_checkpoint(good)
        (good / "config.json").write_text(original)
    with pytest.raises(CheckpointError, match=r"header length"):
        load_checkpoint(good)  # the config is fine: now the file itself is read and refused


def test_a_sliding_window_at_least_the_context_is_full_attention(good):
    _edit_config(good, use_sliding_window=True, sliding_window=1024, max_window_layers=0)
    plan = plan_checkpoint(good, max_context=1024)
    assert plan.config.num_layers == 2 and plan.info.max_context == 1024


def test_index_naming_a_missing_shard(tmp_path):
    cfg = FAMILY_CONFIGS["mistral"]
    ck = write_checkpoint(tmp_path / "ck", cfg, random_tensors(cfg, seed=2, dtype="BF16"), shards=2)
    (ck / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard 'model-00002-of-00002\.safetensors' does not exist"):
        load_checkpoint(ck)


def test_tensor_shapes_of_the_fixtures_are_what_the_loader_expects():
    from ninfer_kv.models.hf import expected_tensors, model_config_from_hf

    for family, cfg in FAMILY_CONFIGS.items():
        model, _ = model_config_from_hf(cfg)
        assert {n: s for n, (_, s) in expected_tensors(model).items()} == tensor_shapes(cfg), family
