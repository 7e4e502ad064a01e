"""The kernel-backend interface: what the shared kernel bodies ask of a Pallas GPU/TPU backend.

The kernel bodies (:mod:`pallas_kernels.attention_core`, :mod:`pallas_kernels.append_core`, the
key sources and addressers of the op modules, :mod:`pallas_kernels.codec_tiles`) are written
against :class:`KernelBackend` and plain ``jax.numpy`` / ``jax.lax``; every operation that depends
on how Pallas lowers the kernel (memory access, program ids, compiler parameters, the
``pallas_call`` itself, addressing limits) goes through the backend object.  The body builds
*indexers* (tuples of int32 scalars and broadcastable int32 arrays, one per ref dimension) and the
backend turns them into memory operations.

A backend is found by the ``backend`` field of the op configs (:mod:`pallas_kernels.config`,
default ``"triton"``): backend ``name`` is the ``BACKEND`` object of the module
``pallas_kernels.<name>_backend`` (:func:`kernel_backend`); the Triton backend is
:mod:`pallas_kernels.triton_backend`.  So a backend is one new module (plus its own helpers, named
for it), and :func:`pallas_kernels.bound.bound_ops` gives the ops running on it for the registry of
:mod:`ninfer_kv.ops.registry`.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from typing import Callable, Mapping, Protocol, runtime_checkable

import jax

__all__ = ["KernelBackend", "kernel_backend", "kernel_backend_names", "resolve_interpret"]

_MODULE_SUFFIX = "_backend"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@runtime_checkable
class KernelBackend(Protocol):
    """The operations a kernel body uses that depend on the Pallas lowering.

    ``ref`` is a kernel ref (an operand or result of :meth:`pallas_call`) or a view of one,
    ``ref.at[indexer]``: the indexer holds one entry per dimension, int32 scalars and int32 arrays
    that broadcast together to the shape of the value loaded or stored (a gather/scatter: the op
    modules compute page, slot and lane addresses themselves).  Masks are bool arrays
    broadcastable to that shape, ``None`` meaning all true.
    """

    name: str

    def program_id(self, axis: int) -> jax.Array:
        """The program's index along grid axis ``axis`` (an int32 scalar)."""

    def load(self, ref, *, mask: jax.Array | None = None, other=None) -> jax.Array:
        """The elements of ``ref`` where ``mask``; ``other`` elsewhere (unspecified when ``other`` is ``None``).

        A masked-off element is never read, so its address may be anything the indexer names.
        """

    def store(self, ref, value: jax.Array, *, mask: jax.Array | None = None) -> None:
        """Write ``value`` into ``ref`` where ``mask``; masked-off elements are not written."""

    def load_scalar(self, ref, idx: tuple) -> jax.Array:
        """``ref[idx]`` for scalar indices (a table entry, a row's position or length)."""

    def check_planes(self, planes: Mapping[str, jax.Array], *, interpret: bool) -> None:
        """Raise ``ValueError`` for a plane this backend cannot address (before a kernel is built)."""

    def pallas_call(
        self,
        kernel: Callable,
        *,
        grid: tuple[int, ...],
        out_shape,
        num_warps: int,
        num_stages: int,
        interpret: bool,
        name: str,
        input_output_aliases: dict[int, int] | None = None,
    ) -> Callable:
        """The callable running ``kernel`` over ``grid``, every operand and result passed whole.

        ``num_warps`` and ``num_stages`` are the config's tuning knobs (the backend maps them to
        its compiler parameters); ``interpret`` runs the Pallas interpreter.
        """


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means: run the Pallas interpreter iff the default JAX backend is the CPU."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret={interpret!r} is invalid; it must be True, False or None")
    return interpret


def kernel_backend_names() -> tuple[str, ...]:
    """The backends present in this package (modules ``pallas_kernels.<name>_backend``)."""
    package = importlib.import_module(__name__.rpartition(".")[0])
    return tuple(sorted(
        m.name[: -len(_MODULE_SUFFIX)] for m in pkgutil.iter_modules(package.__path__)
        if m.name.endswith(_MODULE_SUFFIX)
    ))


def kernel_backend(name: str, op: str = "kernel") -> KernelBackend:
    """The backend object named ``name`` (``BACKEND`` of ``pallas_kernels.<name>_backend``).

    Raises ``ValueError`` naming the backends present when there is none of that name (``op``
    names the kernel that asked, for the message).
    """
    package = __name__.rpartition(".")[0]
    module_name = f"{package}.{name}{_MODULE_SUFFIX}" if isinstance(name, str) and _NAME.match(name) else None
    module = None
    if module_name is not None:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
    backend = getattr(module, "BACKEND", None)
    if backend is None:
        where = f"no module {module_name} with a BACKEND" if module_name else "not a backend name"
        raise ValueError(
            f"no {name!r} implementation of {op} ({where}); available backends: {', '.join(kernel_backend_names())}"
        )
    return backend
