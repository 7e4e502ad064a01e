"""The kernel seam: what every backend shares, what is Triton's, and where a backend is chosen.

* ``pallas_kernels/common`` imports no Pallas module and nothing of a backend subpackage; in the
  Triton backend only ``backend.py`` (its Pallas surface) and ``addressing.py`` import Pallas, and
  only ``backend.py`` uses ``addressing``.
* The kernels never branch on the codec: no module but ``common/codec_tiles.py`` names ``KVCodec``,
  and its table holds a tile for every codec.
* Every Pallas operation of the Triton kernels goes through the ``TritonBackend`` object (the
  Pallas primitives refuse to run outside its methods while every op is lowered for CUDA).
* The registry is the one place a backend is chosen: the configs name none, and ``impl="pallas"``
  loads the Triton ops.
"""

import ast
import dataclasses
import functools
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

import pallas_kernels as pk
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.profiles import KVCodec
from ninfer_kv.ops.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView
from pallas_kernels.common.codec_tiles import CODEC_TILES, codec_tile
from pallas_kernels.triton.backend import TritonBackend

PACKAGE = Path(pk.__file__).resolve().parent
B, H, G, D = 2, 2, 4, 64


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _absolute_imports(path: Path) -> set[str]:
    tree = _tree(path)
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return names


def _pallas_imports(path: Path) -> list[str]:
    return sorted(m for m in _absolute_imports(path) if m.startswith(("jax.experimental.pallas", "jax._src.pallas")))


def _relative_imports(path: Path) -> list[tuple[int, str]]:
    """``(level, target)`` of every relative import, module and names (``from ..a import b``: ``(2, "a")``, ``(2, "a.b")``)."""
    out = []
    for n in ast.walk(_tree(path)):
        if isinstance(n, ast.ImportFrom) and n.level:
            out += [(n.level, n.module or "")] + [(n.level, ".".join(filter(None, (n.module, a.name)))) for a in n.names]
    return out


def test_common_is_backend_neutral_and_only_the_triton_surface_imports_pallas():
    common = sorted((PACKAGE / "common").glob("*.py"))
    assert len(common) >= 5
    assert {p.name: _pallas_imports(p) for p in common if _pallas_imports(p)} == {}
    for path in common:
        outside = [m for level, m in _relative_imports(path) if level > 1]
        outside += sorted(m for m in _absolute_imports(path) if m.startswith("pallas_kernels"))
        assert not outside, f"common/{path.name} imports outside pallas_kernels.common: {outside}"
    triton = {p.name: _pallas_imports(p) for p in (PACKAGE / "triton").glob("*.py")}
    assert {name for name, mods in triton.items() if mods} == {"backend.py", "addressing.py"}
    users = sorted(p.name for p in PACKAGE.rglob("*.py") if any(m.split(".")[-1] == "addressing"
                                                                 for _, m in _relative_imports(p)))
    assert users == ["backend.py"], f"the Triton addressing helper is used outside the Triton backend: {users}"


def _names_kv_codec(path: Path) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "KVCodec" for n in ast.walk(_tree(path))) or any(
        isinstance(n, ast.ImportFrom) and any(a.name == "KVCodec" for a in n.names) for n in ast.walk(_tree(path))
    )


def test_the_kernels_never_branch_on_the_codec():
    table = PACKAGE / "common" / "codec_tiles.py"
    assert _names_kv_codec(table)  # the control: the walker sees the table's codecs
    naming = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p != table and _names_kv_codec(p))
    assert naming == [], f"only common/codec_tiles.py may name KVCodec (the codec tile table): {naming}"


def test_every_codec_has_one_tile():
    assert set(CODEC_TILES) == set(KVCodec)
    for codec, tile in CODEC_TILES.items():
        assert tile.codec is codec and codec_tile(codec) is tile
        with pytest.raises(dataclasses.FrozenInstanceError):
            tile.codec = codec  # noqa: B010 - frozen: the table is the codec's one tile
    with pytest.raises(ValueError, match="no tile for codec"):
        codec_tile("not-a-codec")


_inside = threading.local()
_METHODS = ("program_id", "load", "store", "load_scalar", "check_planes", "pallas_call")


@pytest.fixture
def counted(monkeypatch):
    """Counts of the ``TritonBackend`` methods the kernels call; the Pallas primitives refuse calls from elsewhere."""
    calls = {}

    def method(name):
        original = getattr(TritonBackend, name)

        @functools.wraps(original)
        def call(self, *args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            _inside.depth = getattr(_inside, "depth", 0) + 1
            try:
                return original(self, *args, **kwargs)
            finally:
                _inside.depth -= 1

        monkeypatch.setattr(TritonBackend, name, call)

    def guarded(target, attr):
        original = getattr(target, attr)

        def call(*args, **kwargs):
            assert getattr(_inside, "depth", 0) > 0, f"{attr} called outside the Triton backend object"
            return original(*args, **kwargs)

        monkeypatch.setattr(target, attr, call)

    for name in _METHODS:
        method(name)
    guarded(pl_triton, "load")
    guarded(pl_triton, "store")
    guarded(pl, "program_id")
    guarded(pl, "pallas_call")
    return calls


def _paged_view(profile, order):
    lay = PagedKVStorageLayout(profile, 2, H, D, order)
    planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes(8).items()}
    return PagedKVBatchLayerView(planes, jax.ShapeDtypeStruct((B + 1, 4), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
                                 lay, validate=False)


def _cyclic_view(profile):
    lay = CyclicKVLayout(profile, 2, B + 1, H, D, window=16, slots=32)
    planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes().items()}
    return CyclicKVCacheLayerView(planes, jax.ShapeDtypeStruct((), jnp.int32), lay, validate=False)


_I32 = jax.ShapeDtypeStruct((B,), jnp.int32)


def _tokens(t, heads, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((B, t, heads, D), dtype)


def test_every_pallas_operation_goes_through_the_backend_object(counted):
    pv, cv = _paged_view("k8v4", "head-major"), _cyclic_view("k8v4")
    cases = [
        (lambda v, r, p, k, n: pk.paged_append(v, r, p, k, k, n, interpret=False),
         (pv, _I32, _I32, _tokens(3, H, jnp.float32), _I32)),
        (lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, interpret=False,
                                                  config=pk.PagedAttentionConfig(k_splits=2)),
         (_tokens(1, H * G), pv, _I32, _I32, _I32)),
        (lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, interpret=False,
                                                  config=pk.PagedAttentionConfig(block_k=128)),
         (_tokens(8, H * G, jnp.float32), pv, _I32, _I32, _I32)),
        (lambda v, r, p, k, n: pk.cyclic_append(v, r, p, k, k, n, interpret=False), (cv, _I32, _I32, _tokens(3, H), _I32)),
        (lambda q, v, r, p, n: pk.cyclic_attention(q, v, r, p, n, interpret=False,
                                                   config=pk.CyclicAttentionConfig(k_splits=2)),
         (_tokens(1, H * G), cv, _I32, _I32, _I32)),
    ]
    for fn, args in cases:
        assert "__gpu$xla.gpu.triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for name in _METHODS:
        assert counted.get(name, 0) > 0, f"the kernels never called {name}: {counted}"
    assert counted["pallas_call"] == len(cases)


def test_the_registry_is_where_a_backend_is_chosen():
    from ninfer_kv.ops.registry import load_impl
    from pallas_kernels.triton import cyclic, paged_append, paged_attention

    impl = load_impl("pallas")
    assert (impl.paged_append, impl.paged_attention, impl.cyclic_append, impl.cyclic_attention) == (
        paged_append.paged_append, paged_attention.paged_attention, cyclic.cyclic_append, cyclic.cyclic_attention)
    for config_type in (pk.PagedAppendConfig, pk.CyclicAppendConfig, pk.PagedAttentionConfig, pk.CyclicAttentionConfig):
        assert {f.name for f in dataclasses.fields(config_type)} & {"backend", "num_warps", "num_stages"} == set()
    assert not [p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"], "backend code lives in subpackages"
