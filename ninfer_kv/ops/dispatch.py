"""Implementation registry and selection for the paged and cyclic ops.

An *implementation* provides the four ops of the op contract with the reference signatures
(:mod:`ninfer_kv.ops.reference`).  The registry maps a name to a *loader*: a zero-argument callable
that imports the implementation on first use and returns an :class:`OpImpl`, or raises
:class:`ImplUnavailableError` saying why it cannot (module missing, native library not built).
Loaders run lazily, so ``ninfer_kv.ops`` imports without any kernel package present.

Built-in names:

* ``"reference"`` — :mod:`ninfer_kv.ops.reference` (gather-based jnp, for tests).
* ``"pallas"`` — the top-level ``pallas_kernels`` package (Pallas Triton kernels; interpret mode on
  a CPU backend).
* ``"ffi"`` — :mod:`ninfer_kv.ffi_ops` (C++ XLA FFI CPU kernels).

``impl="auto"`` walks the preference list of the default backend's platform
(:data:`AUTO_PREFERENCE`): Pallas on GPU; FFI on CPU, falling back to the reference with a
:class:`ImplFallbackWarning` (issued once per platform and implementation) when the FFI library is
missing.  A later backend (e.g. a Mosaic GPU variant) is one :func:`register_impl` call plus an
entry in the preference list.

:func:`override_impls` swaps loaders and preferences inside a ``with`` block (tests, experiments);
it also scopes the warn-once memory so a fallback warning inside the block is always observable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading
import warnings
from typing import Callable, Iterator, Mapping

import jax

__all__ = [
    "OpImpl",
    "ImplUnavailableError",
    "ImplFallbackWarning",
    "AUTO",
    "AUTO_PREFERENCE",
    "register_impl",
    "registered_impls",
    "available_impls",
    "load_impl",
    "resolve_impl",
    "override_impls",
    "current_platform",
]

AUTO = "auto"

OP_NAMES = ("paged_append", "paged_attention", "cyclic_append", "cyclic_attention")

REBUILD_HINT = (
    "build the native library with `pip install -e .` (or `pip install .`) from the repository root "
    "(CMake and a C++17 compiler are needed), or pass impl='reference' (slow, for tests)"
)


class ImplUnavailableError(RuntimeError):
    """An implementation cannot be loaded here (module missing, native library not built, ...)."""


class ImplFallbackWarning(RuntimeWarning):
    """``impl="auto"`` could not load its preferred implementation and fell back to another."""


@dataclasses.dataclass(frozen=True)
class OpImpl:
    """One implementation of the four ops, with the signatures of :mod:`ninfer_kv.ops.reference`."""

    name: str
    paged_append: Callable
    paged_attention: Callable
    cyclic_append: Callable
    cyclic_attention: Callable

    @classmethod
    def from_module(cls, name: str, module, *, suffix: str = "") -> "OpImpl":
        """Collect ``paged_append{suffix}``, ... from ``module``; a missing function is unavailable."""
        fns = {}
        for op in OP_NAMES:
            fn = getattr(module, op + suffix, None)
            if not callable(fn):
                raise ImplUnavailableError(
                    f"implementation {name!r}: module {module.__name__} does not define {op + suffix}()"
                )
            fns[op] = fn
        return cls(name=name, **fns)


Loader = Callable[[], OpImpl]


# -- built-in loaders ----------------------------------------------------------------------------


def _load_reference() -> OpImpl:
    from . import reference

    return OpImpl.from_module("reference", reference, suffix="_reference")


def _import(module_name: str, impl: str, hint: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ImplUnavailableError(f"implementation {impl!r} is unavailable: cannot import {module_name} ({e}); {hint}") from e


def _load_pallas() -> OpImpl:
    module = _import("pallas_kernels", "pallas", "install the package with its pallas_kernels directory")
    return OpImpl.from_module("pallas", module)


def _load_ffi() -> OpImpl:
    module = _import("ninfer_kv.ffi_ops", "ffi", REBUILD_HINT)
    if not module.is_available():
        raise ImplUnavailableError(
            f"implementation 'ffi' is unavailable: the XLA FFI library did not load ({module.load_error()}); "
            f"{REBUILD_HINT}"
        )
    return OpImpl.from_module("ffi", module)


# -- registry state ------------------------------------------------------------------------------

AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {
    "gpu": ("pallas",),
    "cpu": ("ffi", "reference"),
}
"""Per-platform order that ``impl="auto"`` tries; the first one that loads wins."""

_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}


@dataclasses.dataclass
class _Registry:
    loaders: dict[str, Loader]
    preference: dict[str, tuple[str, ...]]
    loaded: dict[str, OpImpl] = dataclasses.field(default_factory=dict)
    warned: set = dataclasses.field(default_factory=set)


_lock = threading.RLock()
_registry = _Registry(
    loaders={"reference": _load_reference, "pallas": _load_pallas, "ffi": _load_ffi},
    preference=AUTO_PREFERENCE,
)


def register_impl(name: str, loader: Loader, *, replace: bool = False) -> None:
    """Register ``loader`` under ``name`` (``replace=True`` to redefine an existing name)."""
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"implementation name {name!r} is invalid; it must be a non-empty string other than 'auto'")
    if not callable(loader):
        raise TypeError(f"loader for {name!r} must be callable, got {type(loader).__name__}")
    with _lock:
        if name in _registry.loaders and not replace:
            raise ValueError(f"implementation {name!r} is already registered; pass replace=True to redefine it")
        _registry.loaders[name] = loader
        _registry.loaded.pop(name, None)


def registered_impls() -> tuple[str, ...]:
    """Names accepted by ``impl=`` besides ``"auto"``."""
    with _lock:
        return tuple(_registry.loaders)


def load_impl(name: str) -> OpImpl:
    """Load (once) and return the implementation ``name``.

    Raises:
      ValueError: ``name`` is not registered (the message lists the allowed names).
      ImplUnavailableError: the implementation cannot be loaded here (the message says why and how
        to fix it).
    """
    with _lock:
        if name in _registry.loaded:
            return _registry.loaded[name]
        loader = _registry.loaders.get(name)
        if loader is None:
            raise ValueError(f"impl={name!r} is unknown; allowed: {', '.join((AUTO,) + registered_impls())}")
        impl = loader()
        if not isinstance(impl, OpImpl):
            raise TypeError(f"loader of implementation {name!r} returned {type(impl).__name__}, expected OpImpl")
        _registry.loaded[name] = impl
        return impl


def available_impls() -> tuple[str, ...]:
    """Registered implementations that load in this process."""
    out = []
    for name in registered_impls():
        try:
            load_impl(name)
        except ImplUnavailableError:
            continue
        out.append(name)
    return tuple(out)


def current_platform() -> str:
    """The default backend's platform family: ``"gpu"``, ``"cpu"`` or ``"tpu"``."""
    backend = jax.default_backend()
    return _PLATFORM_ALIASES.get(backend, backend)


def resolve_impl(impl: str = AUTO, *, platform: str | None = None) -> OpImpl:
    """The implementation ``impl`` names; ``"auto"`` picks per platform (default backend if None).

    Raises:
      ValueError: unknown ``impl`` or a platform with no ``auto`` preference.
      ImplUnavailableError: an explicit ``impl`` cannot load, or no ``auto`` candidate can.
    """
    if not isinstance(impl, str):
        raise TypeError(f"impl must be a string, got {type(impl).__name__}; allowed: {', '.join((AUTO,) + registered_impls())}")
    if impl != AUTO:
        return load_impl(impl)
    plat = _PLATFORM_ALIASES.get(platform, platform) if platform is not None else current_platform()
    with _lock:
        candidates = _registry.preference.get(plat)
    if not candidates:
        raise ValueError(
            f"impl='auto' has no preference for platform {plat!r}; known platforms: "
            f"{', '.join(sorted(_registry.preference))}. Pass impl= explicitly"
        )
    failures = []
    for name in candidates:
        try:
            chosen = load_impl(name)
        except ImplUnavailableError as e:
            failures.append((name, str(e)))
            continue
        if failures:
            _warn_fallback(plat, chosen.name, failures)
        return chosen
    detail = "; ".join(msg for _, msg in failures)
    raise ImplUnavailableError(f"impl='auto' on platform {plat!r}: no implementation could load ({detail})")


def _warn_fallback(platform: str, chosen: str, failures: list[tuple[str, str]]) -> None:
    key = (platform, chosen, tuple(name for name, _ in failures))
    with _lock:
        if key in _registry.warned:
            return
        _registry.warned.add(key)
    reasons = "; ".join(msg for _, msg in failures)
    warnings.warn(
        f"ninfer_kv.ops impl='auto' on {platform}: falling back to {chosen!r} because {reasons}. "
        f"The {chosen!r} implementation gathers whole sequences and is much slower.",
        ImplFallbackWarning,
        stacklevel=4,
    )


@contextlib.contextmanager
def override_impls(
    loaders: Mapping[str, Loader] | None = None,
    *,
    preference: Mapping[str, tuple[str, ...]] | None = None,
) -> Iterator[None]:
    """Temporarily replace loaders and/or ``auto`` preferences; restores everything on exit.

    Loaded implementations and the warn-once memory are scoped to the block, so code inside sees
    fresh loads and fallback warnings.  Example (simulate a missing FFI library)::

        def missing():
            raise ImplUnavailableError("simulated")

        with override_impls({"ffi": missing}):
            ops.paged_attention(..., impl="auto")   # warns, runs the reference
    """
    with _lock:
        saved = (_registry.loaders, _registry.preference, _registry.loaded, _registry.warned)
        loaders_new = dict(_registry.loaders)
        for name, loader in (loaders or {}).items():
            if not callable(loader):
                raise TypeError(f"loader for {name!r} must be callable, got {type(loader).__name__}")
            loaders_new[name] = loader
        pref_new = dict(_registry.preference)
        pref_new.update({k: tuple(v) for k, v in (preference or {}).items()})
        _registry.loaders, _registry.preference = loaders_new, pref_new
        _registry.loaded, _registry.warned = {}, set()
    try:
        yield
    finally:
        with _lock:
            _registry.loaders, _registry.preference, _registry.loaded, _registry.warned = saved
