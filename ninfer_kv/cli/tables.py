"""Plain-text rendering for the commands' default view: aligned tables and ``key  value`` lines."""

from __future__ import annotations

from typing import Sequence

__all__ = ["render_table", "kv_lines", "thousands"]


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()) -> str:
    """Render an aligned plain-text table; columns whose index is in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(row):
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(parts).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


def thousands(x: int) -> str:
    """``x`` as an integer with comma thousands separators (``1,048,576``)."""
    return f"{int(x):,}"


def kv_lines(pairs: Sequence[tuple[str, str]]) -> list[str]:
    """``key  value`` lines indented by two spaces, the values aligned in one column."""
    width = max(len(k) for k, _ in pairs)
    return [f"  {k.ljust(width)}  {v}" for k, v in pairs]
