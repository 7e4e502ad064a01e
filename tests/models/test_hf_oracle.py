"""transformers itself as the oracle: tiny Qwen3 / Qwen2 / Llama / Mistral models built and saved by
transformers (random weights, bfloat16), loaded by ``ninfer_kv.models.hf`` and served through the paged
store, must produce transformers' greedy tokens.

* BF16 profile: the tokens of ``model.generate(do_sample=False)`` (its default attention and cache).
* Quantized profiles: a float32 transformers model whose attention sees K and V through the same
  codec (``ninfer_kv.ops.codecs.codec_roundtrip`` of the profile, float32 attention), registered as an
  attention implementation, against the checkpoint served in float32.

Near ties are detected, not hidden: a differing token is accepted only when transformers' own logits
put the two tokens within a near-tie margin of each other, the comparison of that sequence stops
there (the continuations legitimately differ), and the tie is reported as a warning; at least half of
all the tokens must be compared before a tie.  BF16 runs a bfloat16 model, whose logits transformers
rounds to bfloat16 (equal logits are common; it then takes the lower id, the paged steps compare
float32 logits): the margin is :data:`hf_fixtures.BF16_TIE_ULPS` bfloat16 steps.  The quantized profiles run a
float32 model: in bfloat16, two implementations that round RoPE and the projections differently
feed the codec K/V elements one bfloat16 step apart, which the FP8 and NVFP4 codecs turn into whole
code steps; in float32 the codec sees the same values up to float32 rounding, and the margin is
:data:`F32_TIE` logits.

Needs the ``oracle`` extra (``pip install ".[oracle]"``: torch 2.13.0 and transformers); skipped with
the reason elsewhere, never in CI (``CI=true`` turns the missing extra into a failure).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

try:
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the environment
    if os.environ.get("CI") == "true":
        raise ImportError(f"the oracle tests need the 'oracle' extra in CI (pip install '.[oracle]'): {exc}") from exc
    pytest.skip(f"transformers/torch not installed ({exc}); pip install '.[oracle]' to run the oracle tests",
                allow_module_level=True)

import jax  # noqa: E402

from ninfer_kv.ops import codecs  # noqa: E402
from ninfer_kv.models.generate import PagedGenerator  # noqa: E402
from ninfer_kv.models.hf import load_checkpoint, read_header  # noqa: E402
from ninfer_kv.schema.profiles import KVProfile  # noqa: E402

from hf_fixtures import compare_greedy  # noqa: E402

F32_TIE = 1e-3
NEW_TOKENS = 10
COMMON = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.1,
              rms_norm_eps=1e-6, pad_token_id=0)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(rope_theta=500000.0, attention_bias=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, num_key_value_heads=1)),
}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 320, n).tolist() for n in (5, 70, 140)]


def _build(family: str, tmp_path_factory, dtype=torch.bfloat16):
    conf_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, conf_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    directory = tmp_path_factory.mktemp(family)
    model.save_pretrained(directory)
    # the reference is the saved checkpoint loaded as users load it (`.to(bfloat16)` would also round
    # the float32 RoPE inv_freq buffer, which from_pretrained recomputes in float32)
    return getattr(transformers, model_cls).from_pretrained(directory, dtype=dtype).eval(), directory


def _reference(model, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0].float().numpy()


def _compare(what: str, ours: list[int], ref: list[int], ref_logits: np.ndarray, tie=None) -> int:
    """:func:`hf_fixtures.compare_greedy` of :data:`NEW_TOKENS` tokens."""
    assert len(ours) == len(ref) == NEW_TOKENS
    return compare_greedy(what, ours, ref, ref_logits, tie)


# qwen3 (QK norms, a tied head) and qwen2 (q/k/v biases) by default; the plain layers of llama and
# mistral under -m slow.
@pytest.mark.parametrize("family", [f if f in ("qwen3", "qwen2") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_bf16_greedy_tokens_equal_transformers_generate(family, prompts, tmp_path_factory):
    model, directory = _build(family, tmp_path_factory)
    assert read_header(directory / "model.safetensors").tensors  # transformers' file, read by our parser
    loaded = load_checkpoint(directory, dtype="bfloat16")
    gen = PagedGenerator(loaded.params, loaded.config, max_context=256, max_batch=4)
    seqs = gen.generate(prompts, max_new_tokens=NEW_TOKENS)  # one batch: 2 pages, 3 pages, 2 prefill chunks
    # and a fork: a retained checkpoint of the longest prompt's first 100 tokens, continued with the whole prompt
    parent = gen.add(prompts[2][:100], max_new_tokens=1, retain=True)
    gen.run()
    fork = gen.add(prompts[2], max_new_tokens=NEW_TOKENS, source=parent)
    gen.run()
    assert fork.generated == seqs[2].generated  # the fork serves what the whole prompt does, exactly
    compared = 0
    for prompt, seq in zip(prompts, seqs):
        ref, logits = _reference(model, prompt)
        compared += _compare(f"{family} bf16 p{len(prompt)}", seq.generated, ref, logits)
    assert compared >= len(prompts) * NEW_TOKENS // 2, f"{family}: only {compared} tokens compared before near ties"


_PROFILE = {"value": KVProfile.BF16}
_roundtrip = jax.jit(codecs.codec_roundtrip, static_argnums=0)


def _codec(k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The profile's codec round trip of ``(..., D)`` rows, padded to a few row buckets (few compiles)."""
    shape = k.shape
    rows = int(np.prod(shape[:-1]))
    bucket = max(512, 1 << (rows - 1).bit_length())
    kk = np.zeros((bucket, 1, 1, shape[-1]), np.float32)
    vv = np.zeros_like(kk)
    kk[:rows, 0, 0], vv[:rows, 0, 0] = k.reshape(rows, -1), v.reshape(rows, -1)
    kr, vr = _roundtrip(_PROFILE["value"], kk, vv)
    return np.asarray(kr)[:rows].reshape(shape), np.asarray(vr)[:rows].reshape(shape)


def codec_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention over the codec's K and V (float32 scores, softmax and sum)."""
    hk, s = key.shape[1], key.shape[2]
    kr, vr = (np.array(x) for x in _codec(key.float().numpy(), value.float().numpy()))  # writable copies
    g = query.shape[1] // hk
    k32 = torch.from_numpy(kr).repeat_interleave(g, 1)
    v32 = torch.from_numpy(vr).repeat_interleave(g, 1)
    scores = torch.matmul(query.float(), k32.transpose(2, 3)) * scaling
    t = query.shape[2]
    if attention_mask is None:
        scores = scores.masked_fill(~torch.ones(t, s, dtype=torch.bool).tril(s - t), float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., :s], float("-inf"))
    else:
        scores = scores + attention_mask[..., :s].float()
    out = torch.matmul(torch.softmax(scores, -1), v32).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("ninfer_kv_codec", codec_attention)


# nvfp4 (the FFI's reduced-precision int8x2 scores) by default; int8, fp8 and k8v4 under -m slow (each
# codec's ops against the numpy model: tests/conformance).
@pytest.mark.parametrize("profile", [pytest.param("int8-g64", marks=pytest.mark.slow),
                                     pytest.param("fp8-e4m3fn-row256", marks=pytest.mark.slow),
                                     "nvfp4-g16", pytest.param("k8v4", marks=pytest.mark.slow)])
def test_quantized_profiles_equal_a_codec_matched_transformers(profile, prompts, tmp_path_factory):
    model, directory = _build("qwen3", tmp_path_factory, torch.float32)
    model.set_attn_implementation("ninfer_kv_codec")
    _PROFILE["value"] = KVProfile.parse(profile)
    loaded = load_checkpoint(directory, dtype="float32")
    gen = PagedGenerator(loaded.params, loaded.config, profile=profile, max_context=256, max_batch=4)
    seqs = gen.generate(prompts, max_new_tokens=NEW_TOKENS)
    compared = 0
    for prompt, seq in zip(prompts, seqs):
        ref, logits = _reference(model, prompt)
        compared += _compare(f"qwen3 {profile} p{len(prompt)}", seq.generated, ref, logits, tie=lambda _: F32_TIE)
    assert compared >= len(prompts) * NEW_TOKENS // 2, f"{profile}: only {compared} tokens compared before near ties"
