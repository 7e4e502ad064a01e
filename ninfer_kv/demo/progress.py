"""The demo's progress bar on stderr (tqdm), showing when XLA is compiling a step function.

While a bar is open it listens to JAX's compile events (``jax.monitoring``): when a step function
has been lowered and its XLA compile starts, the bar says ``compiling <function>``; when the
compile ends, it goes back to ``serving`` and adds the compile time to its ``compile`` total.
:class:`CompileClock` sums the same compile events over the whole process, for the summary's
``compile_seconds``.
"""

from __future__ import annotations

import sys
from typing import TextIO

from jax import monitoring
from tqdm import tqdm

__all__ = ["DemoProgress", "make_progress", "CompileClock", "LOWERED_EVENT", "COMPILED_EVENT"]

LOWERED_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
"""Recorded when a function has been lowered to MLIR, just before its XLA compile."""
COMPILED_EVENT = "/jax/core/compile/backend_compile_duration"
"""Recorded when XLA has finished compiling a function."""


class CompileClock:
    """Seconds of XLA compilation, summed from ``jax.monitoring`` events (process-wide)."""

    seconds = 0.0
    _registered = False

    @classmethod
    def read(cls) -> float:
        if not cls._registered:
            monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._registered = True
        return cls.seconds

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event == COMPILED_EVENT:
            cls.seconds += float(duration)


class DemoProgress:
    """Finished requests out of ``total``, with generated tokens, tokens/s and the compile phase."""

    def __init__(self, total: int, *, stream: TextIO | None = None, desc: str = "serving requests"):
        self.compile_seconds = 0.0
        self.compiles = 0
        self._facts: dict[str, object] = {}
        self._phase = "starting"
        self._bar = tqdm(
            total=int(total),
            desc=desc,
            unit="req",
            file=stream if stream is not None else sys.stderr,
            dynamic_ncols=True,
            leave=True,
            mininterval=0.2,
        )
        self._show()
        monitoring.register_event_duration_secs_listener(self._on_event)
        self._listening = True

    @property
    def n(self) -> int:
        """Requests finished so far."""
        return self._bar.n

    @property
    def phase(self) -> str:
        """``starting``, ``compiling <function>`` or ``serving``."""
        return self._phase

    def _show(self, refresh: bool = False) -> None:
        postfix = {"now": self._phase, **self._facts}
        if self.compiles:
            postfix["compiled"] = f"{self.compiles} fn in {self.compile_seconds:.1f}s"
        self._bar.set_postfix(postfix, refresh=refresh)

    def _on_event(self, event: str, duration: float, **kwargs: object) -> None:
        if event == LOWERED_EVENT:
            name = str(kwargs.get("fun_name", "a step function"))
            if name.startswith("jit(") and name.endswith(")"):
                name = name[4:-1]
            self._phase = f"compiling {name}"
        elif event == COMPILED_EVENT:
            self._phase = "serving"
            self.compiles += 1
            self.compile_seconds += float(duration)
        else:
            return
        self._show(refresh=True)

    def update(self, n: int = 1, **facts) -> None:
        """``n`` more requests finished; ``facts`` (e.g. ``tokens=...``) replace the shown ones."""
        self._phase = "serving"
        self._facts.update(facts)
        self._show()
        self._bar.update(n)

    def close(self) -> None:
        if self._listening:
            monitoring.unregister_event_duration_listener(self._on_event)
            self._listening = False
        self._show()
        self._bar.close()


class _Silent:
    def update(self, n: int = 1, **facts) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(
    total: int, *, enabled: bool = True, desc: str = "serving requests", stream: TextIO | None = None
) -> "DemoProgress | _Silent":
    """A :class:`DemoProgress` bar over ``total`` requests; a silent stand-in when not ``enabled``."""
    if not enabled:
        return _Silent()
    return DemoProgress(total, desc=desc, stream=stream)
