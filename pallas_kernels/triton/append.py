"""The quantize-and-store body shared by the paged and the cyclic append kernels (Triton).

One program quantizes ``block_t`` consecutive tokens of one (row, KV head) and writes their codes
and scales into the output planes.  Where a token goes is decided by an *addresser*
(paged: block-table lookup; cyclic: ring slot), which returns, for the tile's tokens,

* ``write``: bool ``(block_t,)``, the tokens that must be stored;
* ``index(cols)``: the plane indexer of those tokens for the given lanes (an int32 ``(1, n)`` row
  gives a ``(block_t, n)`` tile, an int32 scalar gives one lane per token, ``(block_t,)``).

Tokens with ``write`` false are never stored (masked stores).  Their addresses name a safe page on
a GPU and an out-of-range one in the interpreter, whose scatter then drops them instead of racing
with a written token.  Quantization is the codec's tile object
(:data:`pallas_kernels.common.codec_tiles.CODEC_TILES`): it names the input lanes it needs and
returns what to store where; this body only loads and stores.

:func:`run_append` is the public-op body (config check, head-dim limit, plane check) and
:func:`append_call` builds and runs the kernel around an addresser factory; both are shared too.
Memory access, program ids and the ``pallas_call`` go through the backend object
(:mod:`pallas_kernels.triton.backend`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ninfer_kv.schema.profiles import KVProfile

from ..common.codec_tiles import codec_tile
from ..common.tiles import Cols, and_masks
from .backend import TRITON, TritonBackend, prepare
from .config import lanes

__all__ = ["quantize_and_store", "storage_planes", "logical_planes", "run_append", "append_call"]


def storage_planes(planes: list, interpret: bool) -> list:
    """The planes as the append kernel receives them.

    On a GPU: unchanged.  In the interpreter, float planes travel bitcast to unsigned integers of
    the same width: the CPU interpreter passes whole float planes through float32 selects, which
    would canonicalize NaN payloads in bytes the append never writes.  Bitcasts copy nothing.
    """
    if not interpret:
        return list(planes)
    return [
        jax.lax.bitcast_convert_type(p, jnp.dtype(f"uint{8 * p.dtype.itemsize}"))
        if jnp.issubdtype(p.dtype, jnp.floating) else p
        for p in planes
    ]


def logical_planes(stored: list, dtypes: list) -> list:
    """Undo :func:`storage_planes`."""
    return [p if p.dtype == dt else jax.lax.bitcast_convert_type(p, dt) for p, dt in zip(stored, dtypes)]


def _as_stored(value: jax.Array, dtype, stored_dtype) -> jax.Array:
    value = value.astype(dtype)
    return value if jnp.dtype(stored_dtype) == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(value, stored_dtype)


Addresser = Callable[[jax.Array], tuple[jax.Array, Callable]]


def quantize_and_store(
    profile: KVProfile,
    head_dim: int,
    num_tokens: int,
    block_t: int,
    backend: TritonBackend,
    *,
    b,
    h,
    t0,
    k_ref,
    v_ref,
    out_refs: dict,
    address: Addresser,
    k_row=None,
    k_shift=0,
) -> None:
    """Quantize tokens ``t0 .. t0 + block_t`` of row ``b``, head ``h`` of K and V and store them.

    Args:
      profile: the pool's KV profile (static).
      head_dim: D (static).
      num_tokens: T of the ``(B, T, H, D)`` inputs (static).
      block_t: tokens per program (static power of two).
      backend: the backend object (memory access).
      b, h, t0: row, KV head and first token of this program (traced int32 scalars).
      k_ref, v_ref: the ``(B, T, H, D)`` inputs.
      out_refs: output plane refs keyed by plane name (in the planes' dtypes or, see
        :func:`storage_planes`, as unsigned integers of the same width).
      address: the addresser (see the module docstring).
      k_row, k_shift: where token ``t`` of the program's row lies in ``k_ref`` / ``v_ref``: token
        ``t + k_shift`` of row ``k_row`` (default: token ``t`` of row ``b``; a ragged block of
        :mod:`pallas_kernels.common.ragged` reads its tokens from the call's one token axis).
    """
    plane_dtypes = {p.name: p.dtype for p in profile.planes(head_dim)}
    t = t0 + jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    write, index = address(t)
    write = write & (t < num_tokens)
    t_safe = jnp.where(write, t, 0)
    write2 = write[:, None]
    tile_lanes = lanes(head_dim)

    def store(name: str, value: jax.Array, where: Cols | int) -> None:
        ref = out_refs[name]
        value = _as_stored(value, plane_dtypes[name], ref.dtype)
        if isinstance(where, int):  # one lane per token
            backend.store(ref.at[index(jnp.int32(where))], value, mask=write)
        else:
            backend.store(ref.at[index(where.index())], value, mask=and_masks(write2, where.mask()))

    for tensor, x_ref in (("k", k_ref), ("v", v_ref)):

        def load(cols: Cols, x_ref=x_ref) -> jax.Array:
            mask = and_masks(write2, cols.mask())
            tile = backend.load(x_ref.at[b if k_row is None else k_row, t_safe[:, None] + k_shift, h, cols.index()],
                                mask=mask, other=0)
            return tile.astype(jnp.float32)

        for put in codec_tile(profile.codec(tensor)).encode(tensor, load, tile_lanes):
            store(*put)


def run_append(op: str, config_type: type, kernel: Callable, view, rows, positions, k, v, valid, *, config,
               interpret):
    """Body of a public append op: default/check ``config``, check the head dim and the planes, run.

    ``config`` must be ``None`` (a default ``config_type()``) or a ``config_type`` (its
    ``compiler`` a :class:`~pallas_kernels.triton.config.TritonConfig` or ``None``);
    ``kernel(backend, view, rows, positions, k, v, valid, config=, compiler=, interpret=)`` returns
    the new planes and the result is ``view.replace(planes=...)``.
    """
    config, compiler, interpret = prepare(config, config_type, view, interpret)
    compiler = compiler.for_append()
    planes = kernel(TRITON, view, rows, positions, k, v, valid, config=config, compiler=compiler, interpret=interpret)
    return view.replace(planes=planes)


AddresserFactory = Callable[..., Addresser]


def append_call(
    backend: TritonBackend,
    *,
    view,
    names: list,
    rows,
    positions,
    valid,
    tables: tuple,
    k,
    v,
    cfg,
    compiler,
    interpret: bool,
    name: str,
    make_address: AddresserFactory,
    row_limit: int,
    ragged: tuple | None = None,
) -> dict:
    """Quantize ``k, v (B, T, H, D)`` into the view's planes in place; returns the planes by name.

    Grid ``(B, ceil(T / block_t), H)``.  The kernel's operands are ``layer (1,)``, ``rows``,
    ``positions``, ``valid`` (int32 ``(B,)``), the ``tables`` (e.g. the block tables), ``k``,
    ``v`` and the planes ``names`` (aliased input -> output, passed through
    :func:`storage_planes`).  Each program calls ``make_address(layer, row, pos, n_valid, h,
    *table_refs)`` for its addresser (see the module docstring) and runs
    :func:`quantize_and_store`.  ``k`` and ``v`` must be non-empty.  A row index ``rows[b]``
    outside ``[0, row_limit)`` makes row ``b`` write nothing (its addresser sees row 0, a safe
    address, and no valid token).

    ``ragged=(starts, block_tokens)``: the rows are the blocks of a ragged call
    (:mod:`pallas_kernels.common.ragged`: ``rows``, ``positions`` and ``valid`` the blocks' table
    rows, first positions and token counts, ``starts`` their first tokens) holding at most
    ``block_tokens`` tokens each, and ``k, v`` are the call's ``(N, H, D)`` inputs; ``starts`` is
    one more scalar operand after ``valid``.
    """
    profile, d = view.layout.profile, view.layout.head_dim
    if ragged is None:
        bsz, t_len, h_len, _ = k.shape
        extra = ()
    else:
        starts, t_len = ragged
        bsz, h_len = rows.shape[0], k.shape[1]
        k, v = k[None], v[None]
        extra = (jnp.asarray(starts, jnp.int32),)
    dtypes = [view.planes[n].dtype for n in names]
    planes = storage_planes([view.planes[n] for n in names], interpret)
    n_tables = len(tables)

    def kernel(layer_ref, rows_ref, pos_ref, valid_ref, *refs):
        starts_ref, refs = (refs[0], refs[1:]) if extra else (None, refs)
        table_refs = refs[:n_tables]
        k_ref, v_ref = refs[n_tables], refs[n_tables + 1]
        out_refs = dict(zip(names, refs[n_tables + 2 + len(names):]))
        b, tile, h = backend.program_id(0), backend.program_id(1), backend.program_id(2)
        row = backend.load_scalar(rows_ref, (b,))
        row_ok = (row >= 0) & (row < row_limit)
        n_valid = backend.load_scalar(valid_ref, (b,))
        n_valid = jnp.where(row_ok, jnp.clip(n_valid, 0, t_len), 0)  # valid is clipped to [0, T]
        layer = backend.load_scalar(layer_ref, (0,))
        row = jnp.where(row_ok, row, 0)
        address = make_address(layer, row, backend.load_scalar(pos_ref, (b,)), n_valid, h, *table_refs)
        quantize_and_store(
            profile, d, t_len, cfg.block_t, backend, b=b, h=h, t0=tile * cfg.block_t,
            k_ref=k_ref, v_ref=v_ref, out_refs=out_refs, address=address,
            **({} if starts_ref is None else {"k_row": 0, "k_shift": backend.load_scalar(starts_ref, (b,))}),
        )

    n_in = 4 + len(extra) + n_tables + 2
    call = backend.pallas_call(
        kernel,
        grid=(bsz, -(-t_len // cfg.block_t), h_len),
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in planes],
        compiler=compiler,
        interpret=interpret,
        name=name,
        input_output_aliases={n_in + i: i for i in range(len(planes))},
    )
    out = call(
        jnp.reshape(jnp.asarray(view.layer, jnp.int32), (1,)),
        jnp.asarray(rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(valid, jnp.int32),
        *extra,
        *tables,
        k,
        v,
        *planes,
    )
    return dict(zip(names, logical_planes(out, dtypes)))
