"""The spec tables are the one source of codec and pool-kind facts.

* every codec's row of ``CODEC_SPECS`` agrees with the C++ kernels' codec table
  (``NINFER_KV_CODECS`` in ``ffi/src/common.h``: id, name, label, storage dtypes and sizes, pack,
  group, head-dim rule), and the Python facts derived from it (plane schema, head-dim rule, demo
  tolerance) read the row; the reference functions are the codec's row of ``CODEC_REFERENCES``;
* every pool kind's row of ``POOL_SPECS`` gives planning its layout and page formula and the store
  its lead.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ninfer_kv.ops import codecs
from ninfer_kv.demo.dense_check import DENSE_TOLERANCES
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, SpeculativeConfig, plan_kv_cache
from ninfer_kv.planning.pool_specs import POOL_SPECS
from ninfer_kv.schema.profiles import CODEC_SPECS, KVCodec, KVProfile
from ninfer_kv.store import KVStore

COMMON_H = Path(__file__).resolve().parents[1] / "ffi" / "src" / "common.h"
_FFI_DTYPE = {"BF16": "bfloat16", "S8": "int8", "F8E4M3FN": "float8_e4m3fn", "U8": "uint8", "INVALID": None}


def _kernel_rows() -> dict[str, dict]:
    """name -> the row of NINFER_KV_CODECS: X(enumerator, id, name, label, data dtype, data bytes, pack,
    scale dtype, scale bytes, group, head-dim multiple)."""
    text = COMMON_H.read_text()
    block = text[text.index("#define NINFER_KV_CODECS(X)"):].split("\n\n")[0]
    rows = re.findall(r'X\((\w+), (\d+), "([^"]+)", "([^"]+)", (\w+), (\d+), (\d+), (\w+), (\d+), (\d+), (\d+)\)',
                      block)
    assert len(rows) == block.count("  X("), block
    return {
        name: dict(ffi_id=int(i), label=label, data=_FFI_DTYPE[data], data_bytes=int(data_bytes), pack=int(pack),
                   scale=_FFI_DTYPE[scale], scale_bytes=int(scale_bytes), group=int(group) or None,
                   head_dim_multiple=int(multiple))
        for _, i, name, label, data, data_bytes, pack, scale, scale_bytes, group, multiple in rows
    }


def test_codec_rows_agree_with_the_kernels_table():
    kernel = _kernel_rows()
    assert list(kernel) == [c.value for c in KVCodec]
    for codec, spec in CODEC_SPECS.items():
        row = kernel[codec.value]
        has_scale = spec.scale_dtype is not None
        assert row == dict(
            ffi_id=spec.ffi_id, label=spec.label, data=spec.code_dtype.name, data_bytes=spec.code_dtype.itemsize,
            pack=spec.pack, scale=spec.scale_dtype.name if has_scale else None,
            scale_bytes=spec.scale_dtype.itemsize if has_scale else 0, group=spec.group,
            head_dim_multiple=spec.head_dim_multiple,
        ), codec
    assert sorted(s.ffi_id for s in CODEC_SPECS.values()) == list(range(len(CODEC_SPECS)))


@pytest.mark.parametrize("codec", list(KVCodec))
def test_codec_facts_come_from_the_row(codec, monkeypatch):
    spec = CODEC_SPECS[codec]
    assert codec.spec is spec and codec.code_dtype == spec.code_dtype and codec.pack == spec.pack
    d = 64 * spec.head_dim_multiple if spec.head_dim_multiple > 1 else 48
    planes = codec.planes("k", d)
    assert planes[0].extent == d // spec.pack and planes[0].dtype == spec.code_dtype
    # the reference functions are public functions of ninfer_kv.ops.codecs, and quantize / dequantize
    # call the codec's row of CODEC_REFERENCES
    ref = codecs.CODEC_REFERENCES[codec]
    for fn in (ref.quantize, ref.dequantize):
        assert fn.__name__ in codecs.__all__ and getattr(codecs, fn.__name__) is fn
    rows = {c: codecs.CodecReference(quantize=lambda x, c=c: ("quantize", c),
                                     dequantize=lambda code, scale, c=c: ("dequantize", c)) for c in KVCodec}
    monkeypatch.setattr(codecs, "CODEC_REFERENCES", rows)
    assert codecs.quantize(codec, np.zeros((1, d), np.float32)) == ("quantize", codec)
    assert codecs.dequantize(codec, None, None) == ("dequantize", codec)
    if spec.head_dim_multiple > 1:
        with pytest.raises(ValueError, match=f"{spec.label} needs head_dim % {spec.head_dim_multiple} == 0"):
            codec.check_head_dim(spec.head_dim_multiple + 1)


def test_profiles_take_their_codecs_largest_tolerance():
    for profile in KVProfile:
        rows = (profile.k_codec.spec, profile.v_codec.spec)
        assert DENSE_TOLERANCES[profile] == max(r.dense_tolerance for r in rows)


@pytest.mark.parametrize("backend", [None, SpeculativeConfig("mtp", draft_window=70, mtp_layers=1),
                                     SpeculativeConfig("dflash", draft_full_layers=1, draft_kv_heads=1,
                                                       draft_head_dim=32)])
def test_pool_rows_give_layouts_page_counts_and_leads(backend):
    plan = plan_kv_cache(ModelKVConfig(2, 2, 64, "k8v4"), max_context=1024, max_concurrency=4,
                         policy=ExplicitCapacity(64 * 64), speculative=backend)
    spec = plan.pool_set.speculative
    assert plan.pool_set.pool_kinds == tuple(k for k, row in POOL_SPECS.items() if row.enabled(spec))
    store = KVStore(plan)
    for kind, pool in plan.pools.items():
        row = POOL_SPECS[kind]
        assert pool.layout.order is row.order
        assert pool.physical_pages == plan.m + 4 * row.lead_pages(spec)
        assert store._rt[kind].lead_tokens == row.lead_tokens(spec)
    if backend is not None and backend.method.value == "mtp":
        assert POOL_SPECS[PoolKind.MTP].lead_pages(spec) == int(np.ceil(69 / 64))
