"""Deviceless TPU compile check: the paged ops and the decoder's steps compiled for TPU chips, no TPU needed.

With ``libtpu`` installed and ``JAX_PLATFORMS=cpu``, ``jax.experimental.topologies.get_topology_desc``
describes a TPU slice whose devices XLA's TPU compiler targets from this machine: every program is
built from ``jax.ShapeDtypeStruct`` arguments placed on the slice's first chip (a single-chip
program) and taken through ``jax.jit(...).lower(...).compile()``.  Nothing runs; the check proves
that each program compiles for that chip generation and reports what ``compiled.memory_analysis()``
says it needs.  Programs, per topology (default ``v5e:2x2`` and ``v6e:2x2``):

``ops``
    ``ninfer_kv.ops.paged_append`` (planes donated) and ``ninfer_kv.ops.paged_attention``, each at a
    decode shape (T = 1) and a chunk (T = 64), for every KV profile, through the TPU backend:
    ``impl="pallas_tpu"`` when :func:`ninfer_kv.ops.registry.registered_impls` lists it (the Mosaic
    TPU Pallas kernels of ``pallas_kernels/mosaic_tpu``), else ``impl="reference"`` (said so in the
    output).  Small shapes: B = 4 rows, H = 2 KV heads, Hq = 8, D = 128, 32 pages of 64 tokens.
    Then the ragged ops' kernels, one class each (the ragged op runs both classes' kernels one after
    the other): ``paged_append_ragged`` and ``paged_attention_ragged`` over a round of B rows of one
    token (``decode``, N = 4) and of 64 tokens (``chunk``, N = 256), each program the one Mosaic
    kernel of :func:`pallas_kernels.mosaic_tpu.ragged.append_class` /
    :func:`~pallas_kernels.mosaic_tpu.ragged.attention_class` (planes donated for the append); with
    ``impl="reference"`` the whole ragged op through ``ninfer_kv.ops``.
``steps``
    The decoder's ``prefill`` (a 128-token chunk), ``decode`` and ``ragged`` (a round of 128 tokens over
    B rows: :meth:`ninfer_kv.models.decoder.steps.ModelSteps.ragged`, the ragged ops' native forms)
    steps of a small Qwen3-like model
    (its ``config.json`` made by :func:`ninfer_kv.models.hf.hf_config_dict` and mapped back by
    :func:`ninfer_kv.models.hf.model_config_from_hf`; bfloat16, 2 layers, d_model 256, 4 query heads
    over 2 KV heads of 128, tied embeddings), for the bf16 and k8v4 pools, batch bucket 4, with the
    same ``impl`` as the ops (so the steps' paged append and attention, ragged or not, are the Mosaic
    kernels).  The
    steps are the jitted functions of :class:`ninfer_kv.models.decoder.steps.ModelSteps`; the
    parameters are shapes only (random weights would be the same program).

The table has one row per program: argument / output / alias / temp / generated-code bytes from
``memory_analysis()``; the scoped VMEM of an op program's Mosaic kernel as Mosaic's compiler states
it (XLA's ``CompiledMemoryStats`` has no VMEM field, so :func:`vmem_probe` compiles the program again
under a 4 KiB limit and reads the size from the compiler's out-of-VMEM error; ``n/r`` for the steps,
whose several kernels the error would not separate); whether the compiled module holds a Mosaic kernel
(``tpu_custom_call``: the Pallas kernels really were lowered for the TPU, not interpreted), and the
compile time.  ``--json PATH`` writes the same rows.

Exit status: 0 when every program compiled, 1 when any did not (the row says why), 2 when libtpu
is missing (one line saying so).

Usage::

    pip install -e ".[tpu-deviceless]"                  # libtpu matching the installed jax
    JAX_PLATFORMS=cpu PYTHONPATH=. python bench/deviceless_tpu.py --json /tmp/tpu_compile.json
    PYTHONPATH=. python bench/deviceless_tpu.py --topologies v6e:2x2 --sections ops --profiles bf16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import time
import traceback
from typing import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the topology's compiler needs no TPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

DEFAULT_TOPOLOGIES = ("v5e:2x2", "v6e:2x2")
SECTIONS = ("ops", "steps")
TPU_IMPL = "pallas_tpu"
PROFILES = ("bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4")
STEP_PROFILES = ("bf16", "k8v4")

# Op shapes: B rows (one spare table row), H KV heads, Hq query heads, head dim D, N pages, table width.
B, H, HQ, D, N_PAGES, WIDTH, LAYERS = 4, 2, 8, 128, 32, 8, 2
OP_SHAPES = (("decode", 1), ("chunk", 64))  # also the ragged rounds: B rows of this many tokens each
STEP_BATCH, STEP_PAGES, STEP_WIDTH, PREFILL_CHUNK, RAGGED_TOKENS = 4, 64, 16, 128, 128


def libtpu_unavailable_reason() -> str | None:
    """``None`` when libtpu is importable here, else one line saying why the check cannot run."""
    if importlib.util.find_spec("libtpu") is None:
        return ('libtpu is not installed: pip install -e ".[tpu-deviceless]" (libtpu matching jax '
                f"{jax.__version__}) to compile for TPU topologies without a TPU")
    return None


def libtpu_version() -> str:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def topology_device(name: str):
    """The first chip of TPU topology ``name`` (as ``get_topology_desc`` accepts it, e.g. ``v5e:2x2``)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(name, "tpu").devices[0]


# -- implementation choice -------------------------------------------------------------------------


def choose_impl(requested: str = "auto") -> tuple[str, str]:
    """``(impl, note)``: ``pallas_tpu`` when registered (or asked for), else ``reference``.

    ``requested``: ``"auto"`` (the TPU backend when registered), ``"pallas_tpu"`` or ``"reference"``.
    """
    from ninfer_kv.ops import registry

    names = registry.registered_impls()
    if TPU_IMPL not in names:
        try:  # the backend may register itself on import (it may not exist yet: then it stays absent)
            importlib.import_module("pallas_kernels.mosaic_tpu")
        except Exception:  # noqa: BLE001  (absent or broken: reported as "not registered")
            pass
        names = registry.registered_impls()
    if requested == "reference":
        return "reference", "impl='reference' as asked"
    if TPU_IMPL in names:
        return TPU_IMPL, f"impl={TPU_IMPL!r} (registered)"
    if requested == TPU_IMPL:
        return TPU_IMPL, f"impl={TPU_IMPL!r} asked for but not registered (registered: {', '.join(names)})"
    return "reference", (f"impl={TPU_IMPL!r} is not registered (registered: {', '.join(names)}): compiling "
                         "impl='reference' instead (XLA gathers, no Mosaic kernel)")


@contextlib.contextmanager
def mosaic_compiled(impl: str, vmem_limit: int | None = None):
    """Inside: ``impl="pallas_tpu"`` runs its kernels with ``interpret=False`` (compiled by Mosaic).

    The backend resolves ``interpret=None`` from ``jax.default_backend()``, which is the CPU here
    (``JAX_PLATFORMS=cpu``), so through ``ninfer_kv.ops`` it would build the TPU *interpreter*
    program.  The deviceless compile targets a TPU chip, where ``None`` means ``False``: the block
    re-registers the backend (:func:`ninfer_kv.ops.registry.override_impls`) with ``interpret=False``
    bound, every other argument and the whole ``ninfer_kv.ops`` path unchanged.  ``vmem_limit``
    also binds a ``config`` whose :class:`~pallas_kernels.mosaic_tpu.backend.MosaicConfig` carries
    that scoped-VMEM limit (the probe of :func:`vmem_probe`).
    """
    if impl != TPU_IMPL:
        yield
        return
    from ninfer_kv.ops import registry

    from pallas_kernels.common.config import PagedAppendConfig, PagedAttentionConfig
    from pallas_kernels.mosaic_tpu.backend import MosaicConfig

    base = registry.load_impl(TPU_IMPL)

    def compiled(fn, config_type):
        if fn is None:
            return None

        def call(*args, **kwargs):
            kwargs.setdefault("interpret", False)
            if vmem_limit is not None:
                kwargs.setdefault("config", config_type(compiler=MosaicConfig(vmem_limit_bytes=vmem_limit)))
            return fn(*args, **kwargs)
        return call

    def loader():
        return registry.OpImpl(
            name=base.name, paged_append=compiled(base.paged_append, PagedAppendConfig),
            paged_attention=compiled(base.paged_attention, PagedAttentionConfig),
            cyclic_append=base.cyclic_append, cyclic_attention=base.cyclic_attention,
            paged_append_ragged=compiled(base.paged_append_ragged, PagedAppendConfig),
            paged_attention_ragged=compiled(base.paged_attention_ragged, PagedAttentionConfig))

    outer = _MOSAIC_LIMIT[0]
    _MOSAIC_LIMIT[0] = vmem_limit
    try:
        with registry.override_impls({TPU_IMPL: loader}):
            yield
    finally:
        _MOSAIC_LIMIT[0] = outer


_MOSAIC_LIMIT: list = [None]
"""The scoped-VMEM limit of the innermost :func:`mosaic_compiled` block (read when a ragged class
program is traced, which happens inside the block)."""


def _mosaic_kwargs(config_type) -> dict:
    """``interpret=False`` and, inside a probe, the probe's VMEM limit: how :func:`mosaic_compiled` binds
    the Mosaic kernels, for programs that call them directly."""
    from pallas_kernels.mosaic_tpu.backend import MosaicConfig

    kwargs = {"interpret": False}
    if _MOSAIC_LIMIT[0] is not None:
        kwargs["config"] = config_type(compiler=MosaicConfig(vmem_limit_bytes=_MOSAIC_LIMIT[0]))
    return kwargs


# -- programs --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Program:
    """One program to compile: ``build(spec)`` returns ``(lowerable, args)``; ``spec(shape, dtype)``
    makes a ``ShapeDtypeStruct`` placed on the target chip."""

    section: str
    name: str
    profile: str
    shape: str
    impl: str
    build: Callable


def _paged_view(spec, profile: str, order: str = "page-major"):
    from ninfer_kv.schema.layout import PagedKVStorageLayout
    from ninfer_kv.ops.views import PagedKVBatchLayerView

    lay = PagedKVStorageLayout(profile, LAYERS, H, D, order)
    planes = {n: spec(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes(N_PAGES).items()}
    return PagedKVBatchLayerView(planes, spec((B + 1, WIDTH), jnp.int32), spec((), jnp.int32), lay, validate=False)


def op_programs(impl: str, profiles=PROFILES, order: str = "page-major") -> list[Program]:
    """Append and attention, decode and chunk, per profile, through ``ninfer_kv.ops`` with ``impl``."""
    from ninfer_kv import ops

    def append_build(profile, t):
        def build(spec):
            fn = jax.jit(lambda view, r, p, k, v, n: ops.paged_append(view, r, p, k, v, n, impl=impl),
                         donate_argnums=0)
            kv = spec((B, t, H, D), jnp.bfloat16)
            vec = spec((B,), jnp.int32)
            return fn, (_paged_view(spec, profile, order), vec, vec, kv, kv, vec)
        return build

    def attention_build(profile, t):
        def build(spec):
            fn = jax.jit(lambda q, view, r, p, n: ops.paged_attention(q, view, r, p, n, impl=impl))
            vec = spec((B,), jnp.int32)
            return fn, (spec((B, t, HQ, D), jnp.bfloat16), _paged_view(spec, profile, order), vec, vec, vec)
        return build

    def ragged_append_build(profile, label, n):
        def build(spec):
            if impl == TPU_IMPL:
                from pallas_kernels.common.config import PagedAppendConfig
                from pallas_kernels.mosaic_tpu import ragged

                def fn(view, r, p, k, v, s):
                    return ragged.append_class(label, view, r, p, k, v, s, **_mosaic_kwargs(PagedAppendConfig))
            else:
                def fn(view, r, p, k, v, s):
                    return ops.paged_append_ragged(view, r, p, k, v, s, impl=impl)
            kv = spec((n, H, D), jnp.bfloat16)
            vec = spec((B,), jnp.int32)
            starts = spec((B + 1,), jnp.int32)
            return jax.jit(fn, donate_argnums=0), (_paged_view(spec, profile, order), vec, vec, kv, kv, starts)
        return build

    def ragged_attention_build(profile, label, n):
        def build(spec):
            if impl == TPU_IMPL:
                from pallas_kernels.common.config import PagedAttentionConfig
                from pallas_kernels.mosaic_tpu import ragged

                def fn(q, view, r, p, kv_lens, s):
                    return ragged.attention_class(label, q, view, r, p, kv_lens, s,
                                                  **_mosaic_kwargs(PagedAttentionConfig))
            else:
                def fn(q, view, r, p, kv_lens, s):
                    return ops.paged_attention_ragged(q, view, r, p, kv_lens, s, impl=impl)
            vec = spec((B,), jnp.int32)
            return jax.jit(fn), (spec((n, HQ, D), jnp.bfloat16), _paged_view(spec, profile, order), vec, vec, vec,
                                 spec((B + 1,), jnp.int32))
        return build

    out = []
    for profile in profiles:
        for label, t in OP_SHAPES:
            shape = f"B{B} T{t} H{H} Hq{HQ} D{D} N{N_PAGES} {order}"
            out.append(Program("ops", f"paged_append {label}", profile, shape, impl, append_build(profile, t)))
            out.append(Program("ops", f"paged_attention {label}", profile, shape, impl, attention_build(profile, t)))
        for label, t in OP_SHAPES:
            n = B * t
            shape = f"R{B} N{n} H{H} Hq{HQ} D{D} N{N_PAGES} {order}"
            out.append(Program("ops", f"paged_append_ragged {label}", profile, shape, impl,
                               ragged_append_build(profile, label, n)))
            out.append(Program("ops", f"paged_attention_ragged {label}", profile, shape, impl,
                               ragged_attention_build(profile, label, n)))
    return out


def qwen3_like_config():
    """A small Qwen3-like ``ModelConfig`` through a ``config.json`` dict (the Hugging Face mapping)."""
    from ninfer_kv.models.decoder.config import ModelConfig
    from ninfer_kv.models.hf import hf_config_dict, model_config_from_hf

    shape = ModelConfig(vocab_size=2048, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                        mlp_dim=768, rope_theta=1_000_000.0, qk_norm=True, tie_embeddings=True)
    doc = hf_config_dict(shape, "qwen3", max_position_embeddings=4096)
    model, _ = model_config_from_hf(doc, dtype="bfloat16")
    return model


def step_programs(impl: str, profiles=STEP_PROFILES) -> list[Program]:
    """The decoder's prefill, decode and ragged steps (shapes only) for each pool profile."""
    from ninfer_kv.models.decoder.config import StepConfig
    from ninfer_kv.models.decoder.steps import make_steps
    from ninfer_kv.models.decoder.weights import param_shapes

    model = qwen3_like_config()
    out = []
    for profile in profiles:
        cfg = StepConfig(model=model, profile=profile, impl=impl, prefill_chunk=PREFILL_CHUNK,
                         batch_buckets=(STEP_BATCH,), token_buckets=(RAGGED_TOKENS,))

        def build_for(step_name, t, cfg=cfg):
            def build(spec):
                steps = make_steps(cfg)
                lay = cfg.main_layout
                params = jax.tree_util.tree_map(lambda s: spec(s.shape, s.dtype), param_shapes(model))
                planes = {n: spec(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes(STEP_PAGES).items()}
                tables = spec((STEP_BATCH + 1, STEP_WIDTH), jnp.int32)
                vec = spec((STEP_BATCH,), jnp.int32)
                step = getattr(steps, step_name)
                if step_name == "ragged":  # tokens (N,), positions (R,), query_starts (R + 1,), table_rows (R,)
                    return step, (params, planes, tables, spec((t,), jnp.int32), vec,
                                  spec((STEP_BATCH + 1,), jnp.int32), vec)
                return step, (params, planes, tables, spec((STEP_BATCH, t), jnp.int32), vec, vec, vec)
            return build

        shape = (f"B{STEP_BATCH} L{model.num_layers} d{model.d_model} Hq{model.num_heads} H{model.num_kv_heads} "
                 f"D{model.head_dim} V{model.vocab_size} N{STEP_PAGES}")
        out.append(Program("steps", f"prefill T={PREFILL_CHUNK}", profile, shape, impl,
                           build_for("prefill", PREFILL_CHUNK)))
        out.append(Program("steps", "decode T=1", profile, shape, impl, build_for("decode", 1)))
        out.append(Program("steps", f"ragged N={RAGGED_TOKENS}", profile, shape, impl,
                           build_for("ragged", RAGGED_TOKENS)))
    return out


# -- compiling -------------------------------------------------------------------------------------


_STAT_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
}


def memory_row(stats) -> dict:
    """The figures of a ``CompiledMemoryStats`` (VMEM only when some field names it)."""
    row = {key: int(getattr(stats, attr, -1)) for key, attr in _STAT_FIELDS.items()}
    vmem = {a: int(getattr(stats, a)) for a in dir(stats) if "vmem" in a.lower() and not a.startswith("_")}
    row["vmem_bytes"] = sum(vmem.values()) if vmem else None
    peak = getattr(stats, "peak_memory_in_bytes", None)
    row["peak_bytes"] = int(peak) if peak is not None else None
    return row


VMEM_PROBE_LIMIT = 1 << 12
"""The scoped-VMEM limit of the probe compile: below any kernel's need, so Mosaic names the need."""

_SCOPED = re.compile(r"Scoped allocation with size ([0-9.]+)([KMG]?)")


def vmem_probe(prog: Program, device) -> int | None:
    """The scoped VMEM Mosaic allocates for the one kernel of ``prog``, from the compiler itself.

    ``compiled.memory_analysis()`` has no VMEM field, but Mosaic checks its scoped allocation
    (double-buffered blocks and scratch) against ``vmem_limit_bytes`` at compile time and names the
    size when it does not fit: the probe compiles ``prog`` again with a 4 KiB limit and reads the
    size from ``CompileTimeScopedVmemOom`` (rounded as Mosaic prints it: three significant digits).
    ``None`` for a program with no Mosaic kernel or several (the error names only the first).
    """
    if prog.impl != TPU_IMPL or prog.section != "ops":
        return None
    sharding = jax.sharding.SingleDeviceSharding(device)
    try:
        with mosaic_compiled(prog.impl, VMEM_PROBE_LIMIT):
            fn, args = prog.build(lambda shape, dtype: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding))
            fn.lower(*args).compile()
    except Exception as exc:  # noqa: BLE001  (the expected outcome: the probe limit is exceeded)
        m = _SCOPED.search(str(exc))
        if m is None:
            raise
        return round(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])
    return VMEM_PROBE_LIMIT  # fits in the probe's limit: at most this


def compile_program(prog: Program, topology: str, device) -> dict:
    """Compile ``prog`` for ``device``; a row with the memory figures or the error."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

    row = {"topology": topology, "chip": device.device_kind, "section": prog.section, "program": prog.name,
           "profile": prog.profile, "shape": prog.shape, "impl": prog.impl}
    t0 = time.perf_counter()
    try:
        with mosaic_compiled(prog.impl):
            fn, args = prog.build(spec)
            compiled = fn.lower(*args).compile()
        row.update(memory_row(compiled.memory_analysis()))
        text = compiled.as_text() or ""
        row["mosaic_kernels"] = text.count("tpu_custom_call")
        if row["vmem_bytes"] is None:
            row["vmem_bytes"] = vmem_probe(prog, device)
        row["ok"], row["error"] = True, None
    except Exception as exc:  # noqa: BLE001  (every failure is a row)
        first = (str(exc).strip().splitlines() or [""])[0]
        row["ok"], row["error"] = False, f"{type(exc).__name__}: {first[:300]}"
        row["traceback"] = traceback.format_exc()
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    return row


def _size(n) -> str:
    if n is None:
        return "n/r"
    if n < 0:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


HEADER = ("| topology | chip | program | profile | impl | argument | output | alias | temp | generated code | "
          "VMEM | Mosaic kernels | compile (s) | result |")


def table_line(row: dict) -> str:
    if not row["ok"]:
        return (f"| {row['topology']} | {row['chip']} | {row['program']} | {row['profile']} | {row['impl']} | "
                f"|  |  |  |  |  |  | {row['compile_s']} | FAIL: {row['error'].replace('|', '/')} |")
    sizes = " | ".join(_size(row[k]) for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                                                 "generated_code_bytes", "vmem_bytes"))
    return (f"| {row['topology']} | {row['chip']} | {row['program']} | {row['profile']} | {row['impl']} | {sizes} | "
            f"{row['mosaic_kernels']} | {row['compile_s']} | ok |")


def run(topologies, sections, impl_request="auto", profiles=PROFILES, step_profiles=STEP_PROFILES,
        order="page-major", log=print) -> dict:
    """Compile every program of ``sections`` for each topology; returns the report (rows and notes)."""
    impl, note = choose_impl(impl_request)
    notes = [note]
    programs: list[Program] = []
    if "ops" in sections:
        programs += op_programs(impl, profiles, order)
    if "steps" in sections:
        programs += step_programs(impl, step_profiles)
    for n in notes:
        log(f"({n})")
    rows = []
    log("")
    log(HEADER)
    log("|" + "---|" * (HEADER.count("|") - 1))
    for topology in topologies:
        try:
            device = topology_device(topology)
        except Exception as exc:  # noqa: BLE001
            first = (str(exc).strip().splitlines() or [""])[0]
            row = {"topology": topology, "chip": "?", "section": "-", "program": "get_topology_desc", "profile": "-",
                   "shape": "-", "impl": "-", "ok": False, "error": f"{type(exc).__name__}: {first[:300]}",
                   "compile_s": 0.0}
            rows.append(row)
            log(table_line(row))
            continue
        for prog in programs:
            row = compile_program(prog, topology, device)
            rows.append(row)
            log(table_line(row))
    return {"jax": jax.__version__, "libtpu": libtpu_version(), "impl": impl, "notes": notes, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", nargs="+", default=list(DEFAULT_TOPOLOGIES),
                        help="TPU topologies as get_topology_desc names them (default: v5e:2x2 v6e:2x2)")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--impl", default="auto", choices=("auto", TPU_IMPL, "reference"),
                        help=f"auto: {TPU_IMPL} when registered, else reference")
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=PROFILES, help="for `ops`")
    parser.add_argument("--step-profiles", nargs="+", default=list(STEP_PROFILES), choices=PROFILES,
                        help="for `steps`")
    parser.add_argument("--order", default="page-major", choices=("page-major", "head-major"), help="for `ops`")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--tracebacks", action="store_true", help="print the traceback of each failure")
    args = parser.parse_args(argv)

    reason = libtpu_unavailable_reason()
    if reason:
        print(reason)
        return 2
    start = time.perf_counter()
    print(f"# Deviceless TPU compile: jax {jax.__version__}, libtpu {libtpu_version()}, "
          f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')}")
    report = run(args.topologies, args.sections, args.impl, args.profiles, args.step_profiles, args.order)
    failed = [r for r in report["rows"] if not r["ok"]]
    if args.tracebacks:
        for r in failed:
            print(f"\n## {r['topology']} {r['program']} {r['profile']}\n{r.get('traceback', '')}")
    report["seconds"] = round(time.perf_counter() - start, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print("")
    print(f"{len(report['rows']) - len(failed)} programs compiled, {len(failed)} failed ({report['seconds']} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
