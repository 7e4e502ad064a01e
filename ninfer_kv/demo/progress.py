"""Progress reporting on stderr: a tqdm bar when tqdm is installed, else a plain status line.

tqdm is optional (the ``demo`` extra).  The fallback rewrites one ``\\r``-terminated line on a
terminal and prints at most one line every ``interval`` seconds (plus the last one) otherwise.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "make_progress"]


class Progress:
    """Counts finished requests and shows ``postfix`` facts (tokens, tokens/s, active lanes)."""

    def __init__(self, total: int, *, stream: TextIO | None = None, interval: float = 0.5, desc: str = "demo"):
        self.total = int(total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.interval = float(interval)
        self.desc = desc
        self._last = 0.0
        self._start = time.perf_counter()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._postfix = ""

    def update(self, n: int = 1, **postfix) -> None:
        self.done += n
        if postfix:
            self._postfix = "  ".join(f"{k} {v}" for k, v in postfix.items())
        now = time.perf_counter()
        if self.done >= self.total or now - self._last >= self.interval:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        line = f"{self.desc}: {self.done}/{self.total} requests  {now - self._start:6.1f} s  {self._postfix}".rstrip()
        self.stream.write(("\r" + line) if self._tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


class _TqdmProgress:
    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=True)

    def update(self, n: int = 1, **postfix) -> None:
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


class _Silent:
    def update(self, n: int = 1, **postfix) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(total: int, *, enabled: bool = True, desc: str = "demo"):
    """A progress reporter: tqdm if importable, else :class:`Progress`; a no-op when disabled."""
    if not enabled:
        return _Silent()
    try:
        return _TqdmProgress(total, desc)
    except ImportError:
        return Progress(total, desc=desc)
