"""The spec tables are the one source of codec and pool-kind facts.

* every codec's row of ``CODEC_SPECS`` agrees with the C++ kernels' codec table
  (``NINFER_KV_CODECS`` in ``ffi/src/common.h``: id, name, storage dtypes), and the Python facts
  derived from it (plane schema, head-dim rule, reference functions, demo tolerance) read the row;
* every pool kind's row of ``POOL_SPECS`` gives planning its layout and page formula and the store
  its lead.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ninfer_kv import codecs
from ninfer_kv.demo.dense_check import DENSE_TOLERANCES
from ninfer_kv.kinds import PoolKind
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, SpeculativeConfig, plan_kv_cache
from ninfer_kv.planning.pool_specs import POOL_SPECS
from ninfer_kv.profiles import CODEC_SPECS, KVCodec, KVProfile
from ninfer_kv.store import KVStore

COMMON_H = Path(__file__).resolve().parents[1] / "ffi" / "src" / "common.h"
_FFI_DTYPE = {"BF16": "bfloat16", "S8": "int8", "F8E4M3FN": "float8_e4m3fn", "U8": "uint8", "INVALID": None}


def _kernel_rows() -> dict[str, tuple]:
    text = COMMON_H.read_text()
    block = text[text.index("#define NINFER_KV_CODECS(X)"):].split("\n\n")[0]
    rows = re.findall(r'X\((\w+), (\d+), "([^"]+)", (\w+), (\w+)\)', block)
    return {name: (int(i), _FFI_DTYPE[data], _FFI_DTYPE[scale]) for _, i, name, data, scale in rows}


def test_codec_rows_agree_with_the_kernels_table():
    kernel = _kernel_rows()
    assert set(kernel) == {c.value for c in KVCodec}
    for codec, spec in CODEC_SPECS.items():
        ffi_id, data, scale = kernel[codec.value]
        assert spec.ffi_id == ffi_id, codec
        assert spec.code_dtype.name == data, codec
        assert (spec.scale_dtype.name if spec.scale_dtype is not None else None) == scale, codec
    assert sorted(s.ffi_id for s in CODEC_SPECS.values()) == list(range(len(CODEC_SPECS)))


@pytest.mark.parametrize("codec", list(KVCodec))
def test_codec_facts_come_from_the_row(codec):
    spec = CODEC_SPECS[codec]
    assert codec.spec is spec and codec.code_dtype == spec.code_dtype and codec.pack == spec.pack
    assert codecs._QUANTIZE[codec] is getattr(codecs, spec.quantize)
    assert codecs._DEQUANTIZE[codec] is getattr(codecs, spec.dequantize)
    d = 64 * spec.head_dim_multiple if spec.head_dim_multiple > 1 else 48
    planes = codec.planes("k", d)
    assert planes[0].extent == d // spec.pack and planes[0].dtype == spec.code_dtype
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
    spec = plan.builder.speculative
    assert plan.builder.pool_kinds == tuple(k for k, row in POOL_SPECS.items() if row.enabled(spec))
    store = KVStore(plan)
    for kind, pool in plan.pools.items():
        row = POOL_SPECS[kind]
        assert pool.layout.order is row.order
        assert pool.physical_pages == plan.m + 4 * row.lead_pages(spec)
        assert store._rt[kind].lead_tokens == row.lead_tokens(spec)
    if backend is not None and backend.backend.value == "mtp":
        assert POOL_SPECS[PoolKind.MTP].lead_pages(spec) == int(np.ceil(69 / 64))
