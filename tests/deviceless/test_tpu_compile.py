"""bench/deviceless_tpu.py: the paged ops, their ragged forms and decoder steps compile for TPU chips without a TPU.

Needs ``libtpu`` (the ``tpu-deviceless`` extra): ``jax.experimental.topologies`` then describes a
TPU slice whose first chip XLA's TPU compiler targets from this CPU-only machine.  Without libtpu
the compiling tests skip, saying so; the exit-code test runs everywhere.
"""

import importlib.util
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.schema.layout import PagedKVStorageLayout

pytestmark = pytest.mark.deviceless

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "deviceless_tpu.py"
_NO_LIBTPU = importlib.util.find_spec("libtpu") is None
needs_libtpu = pytest.mark.skipif(_NO_LIBTPU, reason='libtpu is not importable: pip install -e ".[tpu-deviceless]"')


@pytest.fixture(scope="module")
def dl():
    spec = importlib.util.spec_from_file_location("deviceless_tpu", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _planes_bytes(profile, num_layers, kv_heads, head_dim, num_pages):
    from ninfer_kv.schema.layout import PagedKVStorageLayout

    lay = PagedKVStorageLayout(profile, num_layers, kv_heads, head_dim)
    dtypes = lay.plane_dtypes()
    return sum(math.prod(s) * np.dtype(dtypes[n]).itemsize for n, s in lay.plane_shapes(num_pages).items())


def _check_row(row, impl):
    assert row["ok"], row.get("traceback") or row["error"]
    for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes"):
        assert 0 <= row[key] < 2**30, (key, row)
    assert row["generated_code_bytes"] > 0, row
    if impl == "pallas_tpu":  # the Mosaic kernels were lowered for the chip, not interpreted
        assert row["mosaic_kernels"] >= 1, row


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("profile", ["bf16", "k8v4"])
@pytest.mark.parametrize("which", ["backend", "reference"])
def test_ops_compile_for_tpu(dl, topology, profile, which):
    """``backend``: impl='pallas_tpu' when registered (Mosaic kernels compiled, not interpreted),
    else the reference; ``reference``: the XLA gathers (checks the harness itself)."""
    impl, _ = dl.choose_impl("auto" if which == "backend" else "reference")
    device = dl.topology_device(topology)
    assert device.platform == "tpu"
    planes = _planes_bytes(profile, dl.LAYERS, dl.H, dl.D, dl.N_PAGES)
    progs = {p.name: p for p in dl.op_programs(impl, [profile])}
    append = dl.compile_program(progs["paged_append decode"], topology, device)
    _check_row(append, impl)
    # the planes are donated and aliased input -> output: the append writes in place
    # (the TPU's tiled layouts pad the small scale planes: K8V4's by a third of the pool here)
    assert planes <= append["alias_bytes"] <= 2 * planes, append
    assert append["alias_bytes"] <= append["output_bytes"] <= append["alias_bytes"] + (64 << 10), append
    assert append["alias_bytes"] <= append["argument_bytes"] <= append["alias_bytes"] + (1 << 20), append
    t = dict(dl.OP_SHAPES)["chunk"]
    attn = dl.compile_program(progs["paged_attention chunk"], topology, device)
    _check_row(attn, impl)
    assert attn["output_bytes"] == dl.B * t * dl.HQ * dl.D * 2 and attn["alias_bytes"] == 0, attn
    assert planes <= attn["argument_bytes"] <= 2 * planes + (1 << 20), attn
    if impl == "pallas_tpu":  # Mosaic's own scoped-VMEM figure: at least the two page slots of each plane
        lay = PagedKVStorageLayout(profile, dl.LAYERS, dl.H, dl.D)
        slots = sum(2 * 64 * max(128, s[-1]) * lay.plane_dtypes()[n].itemsize for n, s in lay.plane_shapes(1).items())
        assert slots <= attn["vmem_bytes"] <= 16 << 20, (slots, attn)
        assert dl.VMEM_PROBE_LIMIT < append["vmem_bytes"] <= 16 << 20, append
    else:
        assert attn["vmem_bytes"] is None and append["vmem_bytes"] is None


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("profile", ["bf16", "k8v4"])
def test_ragged_ops_compile_for_tpu(dl, topology, profile):
    """The ragged append and attention, decode and chunk classes: with impl='pallas_tpu' each program is
    one class's Mosaic kernel (the scoped VMEM is that kernel's); without it, the reference's whole op."""
    impl, _ = dl.choose_impl("auto")
    device = dl.topology_device(topology)
    planes = _planes_bytes(profile, dl.LAYERS, dl.H, dl.D, dl.N_PAGES)
    progs = {p.name: p for p in dl.op_programs(impl, [profile]) if "ragged" in p.name}
    assert sorted(progs) == sorted(f"{op}_ragged {label}" for op in ("paged_append", "paged_attention")
                                   for label, _ in dl.OP_SHAPES)
    rows = {name: dl.compile_program(prog, topology, device) for name, prog in progs.items()}
    for label, t in dl.OP_SHAPES:
        n = dl.B * t
        append, attn = rows[f"paged_append_ragged {label}"], rows[f"paged_attention_ragged {label}"]
        for row in (append, attn):
            _check_row(row, impl)
            if impl == "pallas_tpu":  # one class: exactly one kernel
                assert row["mosaic_kernels"] == 1, row
        assert planes <= append["alias_bytes"] <= 2 * planes, append  # planes donated: in place
        # per-block outputs: every token's (Hq, D) row, plus the blocks' padding (at most as much again)
        out = n * dl.HQ * dl.D * 2
        assert out <= attn["output_bytes"] <= 2 * out and attn["alias_bytes"] == 0, attn
        if impl == "pallas_tpu":
            lay = PagedKVStorageLayout(profile, dl.LAYERS, dl.H, dl.D)
            slots = sum(2 * 64 * max(128, s[-1]) * lay.plane_dtypes()[n].itemsize
                        for n, s in lay.plane_shapes(1).items())
            assert slots <= attn["vmem_bytes"] <= 16 << 20, (slots, attn)
            assert dl.VMEM_PROBE_LIMIT < append["vmem_bytes"] <= 16 << 20, append
        else:
            assert attn["vmem_bytes"] is None and append["vmem_bytes"] is None
    if impl == "pallas_tpu":  # page blocks lie in one page: the chunk class reads one window, as a decode
        assert rows["paged_append_ragged chunk"]["vmem_bytes"] == rows["paged_append_ragged decode"]["vmem_bytes"]


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_decoder_ragged_step_compiles_for_tpu(dl, topology):
    """``ModelSteps.ragged`` with impl='pallas_tpu': the native ragged kernels (two classes of append and
    attention per layer), not the generic one-token-per-row form over the rectangular kernels."""
    s_impl, _ = dl.choose_impl("auto")
    device = dl.topology_device(topology)
    prog = next(p for p in dl.step_programs(s_impl, ["k8v4"]) if p.name.startswith("ragged"))
    row = dl.compile_program(prog, topology, device)
    _check_row(row, s_impl)
    model = dl.qwen3_like_config()
    planes = _planes_bytes("k8v4", model.num_layers, model.num_kv_heads, model.head_dim, dl.STEP_PAGES)
    assert row["alias_bytes"] >= planes, row  # planes (and tables) donated
    assert row["output_bytes"] >= planes + dl.STEP_BATCH * model.vocab_size * 4, row  # logits (R, V) float32
    if s_impl == "pallas_tpu":
        assert row["mosaic_kernels"] == 4 * model.num_layers, row


@needs_libtpu
def test_decoder_decode_step_compiles_for_tpu(dl):
    s_impl, _ = dl.choose_impl("auto")
    device = dl.topology_device("v5e:2x2")
    prog = next(p for p in dl.step_programs(s_impl, ["bf16"]) if p.name.startswith("decode"))
    row = dl.compile_program(prog, "v5e:2x2", device)
    _check_row(row, s_impl)
    model = dl.qwen3_like_config()
    planes = _planes_bytes("bf16", model.num_layers, model.num_kv_heads, model.head_dim, dl.STEP_PAGES)
    weights = 2 * (model.vocab_size * model.d_model)  # the tied embedding alone, bfloat16
    assert row["alias_bytes"] >= planes, row  # planes (and tables) donated
    assert row["argument_bytes"] >= planes + weights, row
    # logits (B, V) float32 and the updated planes come back
    assert row["output_bytes"] >= planes + dl.STEP_BATCH * model.vocab_size * 4, row


def test_exit_code_2_without_libtpu(dl, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    assert dl.main(["--sections", "ops", "--profiles", "bf16"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "libtpu is not installed" in out[0]


def test_reference_fallback_is_said(dl):
    impl, note = dl.choose_impl("reference")
    assert impl == "reference" and "reference" in note


@needs_libtpu
@pytest.mark.parametrize("topology", ["v6e:2x2"])
def test_attention_variants_compile_for_tpu(dl, topology):
    """The Mosaic attention with a sliding window, a soft cap and sinks (traced ``(Hq,)`` float32) lowers
    for the chip: the rectangular chunk and the ragged decode class, k8v4, one Mosaic kernel each."""
    impl, _ = dl.choose_impl("auto")
    if impl != "pallas_tpu":
        pytest.skip("impl='pallas_tpu' is not registered")
    from pallas_kernels.common.config import PagedAttentionConfig
    from pallas_kernels.mosaic_tpu import paged_attention
    from pallas_kernels.mosaic_tpu.ragged import attention_class

    t = dict(dl.OP_SHAPES)["chunk"]

    def rect(spec):
        vec = spec((dl.B,), jnp.int32)
        opts = dict(window=100, soft_cap=30.0, **dl._mosaic_kwargs(PagedAttentionConfig))  # the probe's limit
        fn = jax.jit(lambda q, view, r, p, n, s: paged_attention(q, view, r, p, n, sinks=s, **opts))
        return fn, (spec((dl.B, t, dl.HQ, dl.D), jnp.bfloat16), dl._paged_view(spec, "k8v4"), vec, vec, vec,
                    spec((dl.HQ,), jnp.float32))

    def ragged(spec):
        vec = spec((dl.B,), jnp.int32)
        opts = dict(window=100, soft_cap=30.0, **dl._mosaic_kwargs(PagedAttentionConfig))
        fn = jax.jit(lambda q, view, r, p, n, st, s: attention_class("decode", q, view, r, p, n, st, sinks=s, **opts))
        return fn, (spec((dl.B, dl.HQ, dl.D), jnp.bfloat16), dl._paged_view(spec, "k8v4"), vec, vec, vec,
                    spec((dl.B + 1,), jnp.int32), spec((dl.HQ,), jnp.float32))

    device = dl.topology_device(topology)
    for name, build in (("paged_attention chunk variants", rect), ("paged_attention_ragged decode variants", ragged)):
        row = dl.compile_program(dl.Program("ops", name, "k8v4", "", impl, build), topology, device)
        _check_row(row, impl)
        assert row["mosaic_kernels"] == 1 and row["vmem_bytes"] <= 16 << 20, row
