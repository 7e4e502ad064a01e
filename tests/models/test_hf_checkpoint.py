"""Hugging Face checkpoints written here (transformers' tensor names, every family and option) load and
serve through the paged store as an independent numpy forward computes; bad checkpoints fail whole;
loaded parameters are process-owned copies (the files can change or vanish afterwards, nothing stays
open); the stop tokens follow one rule; a corrupt index loads or is refused, nothing else."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_fixtures import FAMILY_CONFIGS, random_tensors, tensor_shapes, write_checkpoint
from np_forward import forward
from ninfer_kv.models.generate import PagedGenerator
from ninfer_kv.models.hf import (
    CheckpointError,
    UnsupportedModelError,
    eos_token_ids,
    expected_tensor_count,
    expected_tensors,
    load_checkpoint,
    model_config_from_hf,
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
        (dict(use_sliding_window=True, sliding_window=1024, layer_types=["chunked_attention", "full_attention"]),
         r"layer_types\[0\]='chunked_attention'"),
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
    assert plan.config.sliding_window is None and plan.config.layer_types is None
    plan = plan_checkpoint(good, max_context=1025)  # one position more: both layers slide
    assert plan.config.sliding_window == 1024 and [plan.config.layer_window(i) for i in range(2)] == [1024, 1024]


def test_index_naming_a_missing_shard(tmp_path):
    cfg = FAMILY_CONFIGS["mistral"]
    ck = write_checkpoint(tmp_path / "ck", cfg, random_tensors(cfg, seed=2, dtype="BF16"), shards=2)
    (ck / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard 'model-00002-of-00002\.safetensors' does not exist"):
        load_checkpoint(ck)


def test_tensor_shapes_of_the_fixtures_are_what_the_loader_expects():
    for family, cfg in FAMILY_CONFIGS.items():
        model, _ = model_config_from_hf(cfg)
        assert {n: s for n, (_, s) in expected_tensors(model).items()} == tensor_shapes(cfg), family


# -- loaded parameters own their memory; files are closed ----------------------------------------------




def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _host(params) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree_util.tree_leaves(params)]


def test_loaded_params_survive_the_file_being_rewritten_and_truncated(tmp_path):
    cfg = dict(FAMILY_CONFIGS["qwen3"], num_hidden_layers=3)  # 47 tensors
    tensors = random_tensors(cfg, seed=7, dtype="BF16")
    ck = write_checkpoint(tmp_path / "ck", cfg, tensors)
    load_checkpoint(ck)  # warm up whatever the backend opens once
    before = _open_fds()
    model = load_checkpoint(ck)
    assert len(jax.tree_util.tree_leaves(model.params)) == len(tensors) == 47
    assert _open_fds() == before  # no descriptor per tensor (nor per file) outlives the load
    path = ck / "model.safetensors"
    assert str(path) not in open("/proc/self/maps").read()  # nothing maps the file
    want = _host(model.params)
    embed = np.array(model.params["embed"], np.float32)
    np.testing.assert_array_equal(np.asarray(model.params["embed"], np.float32),
                                  tensors["model.embed_tokens.weight"].astype(np.float32))
    size = path.stat().st_size
    with open(path, "r+b") as f:  # other bytes in place, then nothing at all
        f.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
        f.truncate(0)
    for got, w in zip(_host(model.params), want):
        np.testing.assert_array_equal(got, w)
    path.unlink()
    total = jax.jit(lambda e: jax.numpy.sum(e.astype(jax.numpy.float32)))(model.params["embed"])
    assert float(total) == pytest.approx(float(embed.sum()), rel=1e-5)


def test_sharded_load_closes_every_shard(tmp_path):
    cfg = FAMILY_CONFIGS["mistral"]
    ck = write_checkpoint(tmp_path / "ck", cfg, random_tensors(cfg, seed=2, dtype="BF16"), shards=3)
    load_checkpoint(ck)
    before = _open_fds()
    model = load_checkpoint(ck)
    assert _open_fds() == before and str(ck) not in open("/proc/self/maps").read()
    for shard in ck.glob("*.safetensors"):
        shard.unlink()
    assert np.isfinite(np.asarray(model.params["final_norm"], np.float32)).all()


# -- one EOS rule ------------------------------------------------------------------------------------


def test_loaded_model_carries_the_eos_rule(tmp_path):
    cfg = FAMILY_CONFIGS["qwen3"]  # config.json: eos_token_id 3
    ck = write_checkpoint(tmp_path / "ck", cfg, random_tensors(cfg, seed=3, dtype="BF16"))
    assert load_checkpoint(ck).eos_token_ids == (3,)
    for gen, want in [({"eos_token_id": [5, 6]}, (5, 6)), ({"eos_token_id": 7}, (7,)), ({"eos_token_id": []}, (3,)),
                      ({"eos_token_id": None}, (3,)), ({"do_sample": True}, (3,))]:
        (ck / "generation_config.json").write_text(json.dumps(gen))
        assert plan_checkpoint(ck).eos_token_ids == want, gen
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 300]}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id=\[5, 300\] holds id 300 outside "
                                              r"the vocabulary; ids must be in \[0, 255\]"):
        load_checkpoint(ck)
    assert eos_token_ids(ck, (3,)) == (5, 300)  # the function keeps working without a vocabulary to check


# -- the inventory before anything proportional to the config ------------------------------------------


def test_more_layers_than_the_files_hold_names_the_first_missing_tensor(good):
    _edit_config(good, num_hidden_layers=4096)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.input_layernorm\.weight' is missing from the "
                                              r"checkpoint \(Qwen2ForCausalLM, 4096 layers"):
        plan_checkpoint(good)


def test_expected_count_matches_the_list():
    for cfg in FAMILY_CONFIGS.values():
        model, _ = model_config_from_hf(cfg)
        assert expected_tensor_count(model) == len(expected_tensors(model))


# -- a corrupt index: a correct load or a CheckpointError naming the index or a shard ------------------

_NAMES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json", "..", ".", "", "/etc/hostname",
          "a/b", "x\0y", "\ud800", "model.safetensors.index.json", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
_LEAVES = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=6) | st.sampled_from(_NAMES))
_INDEX_VALUES = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=3)
                             | st.dictionaries(st.text(max_size=4) | st.sampled_from(_NAMES), inner, max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def sharded_ck(tmp_path_factory):
    cfg = FAMILY_CONFIGS["llama"]
    return write_checkpoint(tmp_path_factory.mktemp("idx"), cfg, random_tensors(cfg, seed=4, dtype="BF16"), shards=2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["entry", "new", "delete", "weight_map", "doc"]), st.sampled_from(_NAMES[10:] + ["lm_head.weight"]),
       _INDEX_VALUES)
def test_random_index_values_load_or_are_refused(sharded_ck, how, key, value):
    index = sharded_ck / "model.safetensors.index.json"
    original = index.read_text()
    doc = json.loads(original)
    if how in ("entry", "new"):
        doc["weight_map"][key if how == "entry" and key in doc["weight_map"] else str(value)[:20]] = value
    elif how == "delete":
        doc["weight_map"].pop(key, None)
    elif how == "weight_map":
        doc["weight_map"] = value
    else:
        doc = value
    index.write_text(json.dumps(doc))
    try:
        model = load_checkpoint(sharded_ck)
        assert len(jax.tree_util.tree_leaves(model.params)) == len(tensor_shapes(FAMILY_CONFIGS["llama"]))
    except CheckpointError as exc:
        assert "model.safetensors.index.json" in str(exc) or ".safetensors" in str(exc) or "tensor" in str(exc)
    finally:
        index.write_text(original)


def test_gemma_checkpoints_round_trip_under_transformers_names(tmp_path):
    """Gemma's sandwich norms are written and read under transformers' names (``post_attention_layernorm``
    is the attention output's norm there, ``pre_feedforward_layernorm`` the MLP input's)."""
    from ninfer_kv.models.decoder import init_params
    from ninfer_kv.models.hf import read_header, save_random_checkpoint
    from ninfer_kv.models.hf.published_configs import GEMMA_3_1B_IT

    cfg = dict(GEMMA_3_1B_IT, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=32, torch_dtype="float32")
    save_random_checkpoint(tmp_path, cfg, seed=4, dtype="float32")
    names = set(read_header(tmp_path / "model.safetensors").tensors)
    for part in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        assert f"model.layers.1.{part}.weight" in names
    assert "lm_head.weight" not in names  # tied
    loaded = load_checkpoint(tmp_path, dtype="float32")
    want = init_params(loaded.config, 4)
    for i in range(2):
        for key in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "w_gate"):
            np.testing.assert_array_equal(np.asarray(loaded.params["layers"][i][key]), np.asarray(want["layers"][i][key]))
