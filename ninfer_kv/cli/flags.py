"""Errors speak in flags: library parameter names (``max_context``) become the flags that set them.

A ``ValueError`` from the library names its parameters; :func:`speak_in_flags` rewrites each as its
flag (``--max-context``) and marks the first mention of a flag the user did not type as a default.
"""

from __future__ import annotations

import argparse
import re
from typing import Sequence

__all__ = ["PARAMETER_FLAGS", "typed_flags", "speak_in_flags"]

PARAMETER_FLAGS: dict[str, str] = {
    "num_layers": "--layers",
    "num_kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "num_pages": "--pages",
    "profile": "--profile",
    "max_context": "--max-context",
    "max_concurrency": "--max-concurrency",
    "kv_capacity": "--kv-capacity",
    "free_bytes": "--free-bytes",
    "headroom_bytes": "--headroom-bytes",
    "fixed_bytes": "--fixed-bytes",
    "draft_window": "--draft-window",
    "mtp_layers": "--mtp-layers",
    "draft_full_layers": "--draft-full-layers",
    "draft_kv_heads": "--draft-kv-heads",
    "draft_head_dim": "--draft-head-dim",
    "mesh": "--mesh",
}
"""Library parameter names and the flags that set them (errors from the library speak in flags)."""

_PARAMETER_RE = re.compile(
    r"\b(" + "|".join(sorted(PARAMETER_FLAGS, key=len, reverse=True)) + r")\b(?:=('[^']*'|[^\s,;)]+))?"
)


def typed_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The option strings the user typed (``--flag``, ``--flag=value`` or an unambiguous prefix)."""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    typed = set()
    for token in argv:
        if not token.startswith("--") or token == "--":
            continue
        name = token.split("=", 1)[0]
        hits = [o for o in options if o == name] or [o for o in options if o.startswith(name)]
        if len(hits) == 1:
            typed.add(hits[0])
    return typed


def speak_in_flags(message: str, parser: argparse.ArgumentParser, argv: Sequence[str]) -> str:
    """Rewrite library parameter names as flags; mark the first mention of each flag not typed."""
    canonical = {o: a.option_strings[0] for a in parser._actions for o in a.option_strings}
    typed = {canonical[o] for o in typed_flags(parser, argv)}
    marked: set[str] = set()

    def flag(match: re.Match) -> str:
        name = PARAMETER_FLAGS[match.group(1)]
        text = name if match.group(2) is None else f"{name} {match.group(2)}"
        if name in typed or name in marked or name not in canonical:
            return text
        marked.add(name)
        return f"{text} (the default; not on the command line)"

    return _PARAMETER_RE.sub(flag, message)
