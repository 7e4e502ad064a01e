"""The kernel registry: one table of ``(op, backend)`` entries for the paged and cyclic ops.

An *entry* says which function implements one op (``paged_append``, ``paged_attention``,
``cyclic_append``, ``cyclic_attention``; the signatures of :mod:`ninfer_kv.ops.reference`) on one
*backend* (``"reference"``, ``"ffi"``, ``"pallas"``, ...).  The backend names are what ``impl=``
accepts besides ``"auto"``.  A target is the function itself or a ``"module:attribute"`` string
that is imported on first use, so registering a backend imports nothing: this module imports only
the standard library, and ``ninfer_kv.ops`` imports without any kernel package present.

Registering (the built-in backends are registered by :mod:`ninfer_kv.ops.dispatch`):

* :func:`register_backend` — a backend's entries, its availability check and the hint shown when
  it cannot load; one call per backend.
* :func:`register_op` — one entry (a backend may provide some ops only; the others raise
  :class:`ImplUnavailableError` when called with that ``impl``).
* :func:`register_impl` — a backend given as a loader returning an :class:`OpImpl` (all four ops).

Loading a backend (:func:`load_impl`, once per process) runs its check, imports its targets and
returns an :class:`OpImpl`; a backend that cannot load raises :class:`ImplUnavailableError` saying
why and how to fix it.  ``impl="auto"`` (:func:`resolve_impl`) walks the preference list of the
default backend's platform (:data:`AUTO_PREFERENCE`) and takes the first backend that loads, the
ops it lacks from the next ones that provide them, warning once (:class:`ImplFallbackWarning`)
when it had to skip or complete one.

:func:`override_impls` swaps backends and preferences inside a ``with`` block (tests,
experiments); it also scopes the loaded backends and the warn-once memory to the block.

This table is the one place a backend is chosen, Pallas kernel backends included: each of them
(Triton and Mosaic TPU today) is a subpackage ``pallas_kernels/<backend>/`` whose ops run on that
backend only (no config field or module-name lookup picks a backend), and an
``impl=`` name registered here maps to them, e.g.
``register_backend("pallas_tpu", {op: "pallas_kernels.<backend>.<module>:<op>", ...})`` plus the
name in :data:`AUTO_PREFERENCE` for ``impl="auto"`` to try it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading
import warnings
from typing import Callable, Iterator, Mapping, Union

__all__ = [
    "OP_NAMES",
    "RAGGED_OP_NAMES",
    "AUTO",
    "AUTO_PREFERENCE",
    "OpImpl",
    "ImplUnavailableError",
    "ImplFallbackWarning",
    "register_backend",
    "register_op",
    "register_impl",
    "registered_impls",
    "impl_choices",
    "registered_ops",
    "available_impls",
    "load_impl",
    "resolve_impl",
    "override_impls",
    "current_platform",
]

AUTO = "auto"

OP_NAMES = ("paged_append", "paged_attention", "cyclic_append", "cyclic_attention")
"""The ops of the op contract, in the order of :class:`OpImpl`'s fields."""

RAGGED_OP_NAMES = ("paged_append_ragged", "paged_attention_ragged")
"""The ragged forms of the paged ops (:mod:`ninfer_kv.ops.ragged`): optional entries.  A backend
without them runs them as its rectangular op over one query per row; ``impl="auto"`` never
completes them from another backend."""


class ImplUnavailableError(RuntimeError):
    """An implementation cannot be loaded here (module missing, native library not built, ...)."""


class ImplFallbackWarning(RuntimeWarning):
    """``impl="auto"`` could not load its preferred implementation and fell back to another."""


@dataclasses.dataclass(frozen=True)
class OpImpl:
    """One implementation of the four ops, with the signatures of :mod:`ninfer_kv.ops.reference`,
    and optionally native ragged forms (``None``: the generic form, :mod:`ninfer_kv.ops.ragged`)."""

    name: str
    paged_append: Callable
    paged_attention: Callable
    cyclic_append: Callable
    cyclic_attention: Callable
    paged_append_ragged: Callable | None = None
    paged_attention_ragged: Callable | None = None

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
        for op in RAGGED_OP_NAMES:  # optional
            fn = getattr(module, op + suffix, None)
            fns[op] = fn if callable(fn) else None
        return cls(name=name, **fns)


Target = Union[Callable, str]
"""An op function, or ``"module:attribute"`` naming one (imported on first use)."""

Loader = Callable[[], OpImpl]
"""A zero-argument callable returning an :class:`OpImpl` (or raising :class:`ImplUnavailableError`)."""

Check = Union[Callable[[], "str | None"], str]
"""An availability check: returns ``None`` when the backend can run, else why it cannot."""


AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {
    "gpu": ("pallas",),
    "cpu": ("ffi", "reference"),
    "tpu": ("pallas_tpu", "reference"),
}
"""Per-platform order that ``impl="auto"`` tries; the first one that loads wins."""

_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}

_MISSING = "__ninfer_kv_missing_op__"


@dataclasses.dataclass(frozen=True)
class _Backend:
    """What is registered under one backend name (immutable: registering builds a new record)."""

    name: str
    entries: Mapping[str, Target] = dataclasses.field(default_factory=dict)  # op -> target
    loader: Loader | None = None  # register_impl / override_impls: all four ops at once
    check: Check | None = None
    hint: str = ""


@dataclasses.dataclass
class _Registry:
    backends: dict[str, _Backend]  # in registration order
    preference: dict[str, tuple[str, ...]]
    loaded: dict[str, OpImpl] = dataclasses.field(default_factory=dict)
    warned: set = dataclasses.field(default_factory=set)


_lock = threading.RLock()
_registry = _Registry(backends={}, preference=AUTO_PREFERENCE)


# -- registering ---------------------------------------------------------------------------------


def _check_name(name) -> None:
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"implementation name {name!r} is invalid; it must be a non-empty string other than 'auto'")


def _check_op(op) -> None:
    if op not in OP_NAMES + RAGGED_OP_NAMES:
        raise ValueError(f"unknown op {op!r}; allowed: {', '.join(OP_NAMES + RAGGED_OP_NAMES)}")


def _check_target(what: str, target) -> None:
    if isinstance(target, str):
        module, sep, attr = target.partition(":")
        if not (module and sep and attr):
            raise ValueError(f"{what}: target {target!r} must be a callable or 'module:attribute'")
    elif not callable(target):
        raise TypeError(f"{what} must be callable or 'module:attribute', got {type(target).__name__}")


def _put(backend: _Backend, *, replace: bool) -> None:
    with _lock:
        if backend.name in _registry.backends and not replace:
            raise ValueError(
                f"implementation {backend.name!r} is already registered; pass replace=True to redefine it"
            )
        _registry.backends[backend.name] = backend
        _registry.loaded.pop(backend.name, None)


def register_backend(
    name: str,
    ops: Mapping[str, Target],
    *,
    check: Check | None = None,
    hint: str = "",
    replace: bool = False,
) -> None:
    """Register backend ``name`` with its entries ``ops`` (op name -> target); the one call a backend needs.

    Args:
      name: the ``impl=`` name (not ``"auto"``).
      ops: some or all of :data:`OP_NAMES` (and :data:`RAGGED_OP_NAMES`), each mapped to its function or to
        ``"module:attribute"`` (imported when the backend is first loaded, so nothing is imported
        here).
      check: optional availability check, a callable or ``"module:attribute"``, run on first load
        before the targets are imported: it returns ``None`` when the backend can run here, else a
        sentence saying why not (the backend is then unavailable).  It may raise to refuse louder.
      hint: what to do when the backend cannot load (appended to the error message).
      replace: redefine an already registered backend.
    """
    _check_name(name)
    if not isinstance(ops, Mapping) or not ops:
        raise TypeError(f"ops of implementation {name!r} must be a non-empty mapping of op name -> target")
    for op, target in ops.items():
        _check_op(op)
        _check_target(f"{op} of implementation {name!r}", target)
    if check is not None:
        _check_target(f"check of implementation {name!r}", check)
    _put(_Backend(name, dict(ops), check=check, hint=str(hint)), replace=replace)


def register_op(op: str, backend: str, target: Target, *, replace: bool = False) -> None:
    """Register ``target`` as the implementation of ``op`` on ``backend`` (a new backend or an existing one).

    ``replace=True`` redefines an entry that is already registered.
    """
    _check_op(op)
    _check_name(backend)
    _check_target(f"{op} of implementation {backend!r}", target)
    with _lock:
        current = _registry.backends.get(backend)
        if current is None:
            current = _Backend(backend)
        elif op in current.entries and not replace:
            raise ValueError(f"{op} of implementation {backend!r} is already registered; pass replace=True to redefine it")
        _put(dataclasses.replace(current, entries={**current.entries, op: target}), replace=True)


def register_impl(name: str, loader: Loader, *, replace: bool = False) -> None:
    """Register ``loader`` under ``name`` (``replace=True`` to redefine an existing name).

    ``loader()`` runs on first use and returns an :class:`OpImpl` (its four functions are the
    backend's entries) or raises :class:`ImplUnavailableError`.
    """
    _check_name(name)
    if not callable(loader):
        raise TypeError(f"loader for {name!r} must be callable, got {type(loader).__name__}")
    _put(_Backend(name, loader=loader), replace=replace)


def registered_impls() -> tuple[str, ...]:
    """Names accepted by ``impl=`` besides ``"auto"`` (in registration order)."""
    with _lock:
        return tuple(_registry.backends)


def impl_choices() -> tuple[str, ...]:
    """Every value ``impl=`` accepts: ``"auto"`` then the registered implementations."""
    return (AUTO,) + registered_impls()


def registered_ops(backend: str | None = None) -> tuple[tuple[str, str], ...]:
    """The ``(op, backend)`` entries registered (of one backend, or of all); nothing is loaded.

    A backend registered with a loader (:func:`register_impl`) lists all four ops.
    """
    with _lock:
        out = []
        for b in _registry.backends.values():
            if backend is not None and b.name != backend:
                continue
            ops = OP_NAMES if b.loader is not None else ()
            ops += tuple(op for op in OP_NAMES + RAGGED_OP_NAMES if op in b.entries and op not in ops)
            out.extend((op, b.name) for op in ops)
        return tuple(out)


# -- loading -------------------------------------------------------------------------------------


def _unavailable(backend: _Backend, reason: str) -> ImplUnavailableError:
    hint = f"; {backend.hint}" if backend.hint else ""
    return ImplUnavailableError(f"implementation {backend.name!r} is unavailable: {reason}{hint}")


def _resolve(backend: _Backend, target: Target, what: str) -> Callable:
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise _unavailable(backend, f"cannot import {module_name} ({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ImplUnavailableError(f"implementation {backend.name!r}: module {module_name} does not define {attr}() ({what})")
    return fn


def _missing_op(name: str, op: str, provided: tuple[str, ...]) -> Callable:
    def missing(*args, **kwargs):
        raise ImplUnavailableError(
            f"implementation {name!r} has no {op} (it provides {', '.join(provided) or 'nothing'}); "
            f"pass another impl="
        )

    setattr(missing, _MISSING, True)
    missing.__name__ = f"{op}_missing"
    return missing


def _load(backend: _Backend) -> OpImpl:
    if backend.check is not None:
        reason = _resolve(backend, backend.check, "availability check")()
        if reason:
            raise _unavailable(backend, str(reason))
    fns: dict[str, Callable] = {}
    label = backend.name
    if backend.loader is not None:
        impl = backend.loader()
        if not isinstance(impl, OpImpl):
            raise TypeError(f"loader of implementation {backend.name!r} returned {type(impl).__name__}, expected OpImpl")
        label = impl.name
        fns = {op: getattr(impl, op) for op in OP_NAMES + RAGGED_OP_NAMES if getattr(impl, op) is not None}
    for op, target in backend.entries.items():
        fns[op] = _resolve(backend, target, op)
    provided = tuple(op for op in OP_NAMES if op in fns)
    return OpImpl(label, **{op: fns.get(op) or _missing_op(backend.name, op, provided) for op in OP_NAMES},
                  **{op: fns.get(op) for op in RAGGED_OP_NAMES})


def load_impl(name: str) -> OpImpl:
    """Load (once) and return the implementation ``name``.

    Ops the backend does not provide are functions raising :class:`ImplUnavailableError`.

    Raises:
      ValueError: ``name`` is not registered (the message lists the allowed names).
      ImplUnavailableError: the implementation cannot be loaded here (the message says why and how
        to fix it).
    """
    with _lock:
        if name in _registry.loaded:
            return _registry.loaded[name]
        backend = _registry.backends.get(name)
        if backend is None:
            raise ValueError(f"impl={name!r} is unknown; allowed: {', '.join((AUTO,) + registered_impls())}")
        impl = _load(backend)
        _registry.loaded[name] = impl
        return impl


def _missing_ops(impl: OpImpl) -> tuple[str, ...]:
    return tuple(op for op in OP_NAMES if getattr(getattr(impl, op), _MISSING, False))


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
    import jax  # here, not at the top: the registry itself imports only the standard library

    backend = jax.default_backend()
    return _PLATFORM_ALIASES.get(backend, backend)


def resolve_impl(impl: str = AUTO, *, platform: str | None = None) -> OpImpl:
    """The implementation ``impl`` names; ``"auto"`` picks per platform (default backend if None).

    ``"auto"`` takes the first backend of the platform's preference list that loads; ops it does not
    provide come from the next backends of the list that do (the result is named after all of them,
    e.g. ``"pallas_tpu+reference"``), with one :class:`ImplFallbackWarning` per platform.

    Raises:
      ValueError: unknown ``impl`` or a platform with no ``auto`` preference.
      ImplUnavailableError: an explicit ``impl`` cannot load, or no ``auto`` candidate can.
    """
    if not isinstance(impl, str):
        raise TypeError(f"impl must be a string, got {type(impl).__name__}; allowed: {', '.join(impl_choices())}")
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
    failures: list[tuple[str, str]] = []
    chosen, need, filled = None, (), {}
    for name in candidates:
        try:
            impl = load_impl(name)
        except ImplUnavailableError as e:
            failures.append((name, str(e)))
            continue
        missing = _missing_ops(impl)
        if chosen is None:
            if len(missing) == len(OP_NAMES):
                failures.append((name, f"implementation {name!r} provides no op"))
                continue
            chosen, need = impl, missing
            if missing:
                failures.append((name, f"implementation {name!r} does not provide {', '.join(missing)}"))
        else:  # a later candidate completes the ops the chosen one lacks
            for op in need:
                if op not in filled and op not in missing:
                    filled[op] = (name, getattr(impl, op))
        if chosen is not None and all(op in filled for op in need):
            break
    if chosen is None or not all(op in filled for op in need):
        detail = "; ".join(msg for _, msg in failures)
        raise ImplUnavailableError(f"impl='auto' on platform {plat!r}: no implementation could load ({detail})")
    if filled:
        donors = "+".join(dict.fromkeys(n for n, _ in filled.values()))
        chosen = dataclasses.replace(chosen, name=f"{chosen.name}+{donors}", **{op: fn for op, (_, fn) in filled.items()})
    if failures:
        _warn_fallback(plat, chosen.name, failures)
    return chosen


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
    """Temporarily replace backends (by loaders) and/or ``auto`` preferences; restores everything on exit.

    Each ``loaders[name]`` replaces backend ``name`` (or adds it) as :func:`register_impl` would.
    Loaded implementations and the warn-once memory are scoped to the block, so code inside sees
    fresh loads and fallback warnings.  Example (simulate a missing FFI library)::

        def missing():
            raise ImplUnavailableError("simulated")

        with override_impls({"ffi": missing}):
            ops.paged_attention(..., impl="auto")   # warns, runs the reference
    """
    with _lock:
        saved = (_registry.backends, _registry.preference, _registry.loaded, _registry.warned)
        backends_new = dict(_registry.backends)
        for name, loader in (loaders or {}).items():
            if not callable(loader):
                raise TypeError(f"loader for {name!r} must be callable, got {type(loader).__name__}")
            backends_new[name] = _Backend(name, loader=loader)
        pref_new = dict(_registry.preference)
        pref_new.update({k: tuple(v) for k, v in (preference or {}).items()})
        _registry.backends, _registry.preference = backends_new, pref_new
        _registry.loaded, _registry.warned = {}, set()
    try:
        yield
    finally:
        with _lock:
            _registry.backends, _registry.preference, _registry.loaded, _registry.warned = saved
