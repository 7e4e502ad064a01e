"""The subcommand registry: :class:`CommandOutput`, :class:`Subcommand` and :func:`register_subcommand`.

A leaf of :mod:`ninfer_kv.cli`: it imports nothing of the package.  The built-in commands register
themselves when :mod:`ninfer_kv.cli` imports them; the modules named in :data:`SUBCOMMAND_MODULES`
(the ``demo`` command) are imported by :func:`registered_subcommands`, when the parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from typing import Callable

__all__ = ["CommandOutput", "Subcommand", "SUBCOMMAND_MODULES", "register_subcommand", "registered_subcommands"]

SUBCOMMAND_MODULES: tuple[str, ...] = ("ninfer_kv.demo.cli", "ninfer_kv.server.cli")
"""Dotted names of modules that register further subcommands when imported (besides the built-ins)."""


@dataclasses.dataclass(frozen=True)
class CommandOutput:
    """What a subcommand produced: ``data`` for ``--json`` and ``text`` for the default view, and
    the exit status after printing them (``EXIT_CHECK_FAILED`` when a check the command ran
    failed, e.g. the demo's dense check)."""

    data: dict
    text: str
    exit_code: int = 0


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """One registered subcommand.

    Attributes:
      name: the subcommand word on the command line.
      help: one-line description shown by ``ninfer-kv --help``.
      configure: adds the subcommand's arguments to its ``argparse`` parser (``--json`` is added by
        the registry for every subcommand).
      run: executes the parsed namespace; returns a :class:`CommandOutput` or ``None``.
    """

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], "CommandOutput | None"]


_REGISTRY: dict[str, Subcommand] = {}


def register_subcommand(
    name: str,
    *,
    help: str,
    configure: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], "CommandOutput | None"] | None = None,
):
    """Register a subcommand; usable directly (pass ``run``) or as a decorator on ``run``.

    Names are unique: registering a taken name raises ``ValueError`` and leaves the registry unchanged.
    """
    if not re.fullmatch(r"[a-z][a-z0-9-]*", name or ""):
        raise ValueError(f"subcommand name {name!r} is invalid; use lowercase letters, digits and '-'")

    def _register(fn):
        if name in _REGISTRY and _REGISTRY[name].run is not fn:
            raise ValueError(f"subcommand {name!r} is already registered")
        _REGISTRY[name] = Subcommand(name=name, help=help, configure=configure, run=fn)
        return fn

    if run is not None:
        return _register(run)
    return _register


def registered_subcommands() -> dict[str, Subcommand]:
    """A copy of the registry (built-ins plus everything imported from :data:`SUBCOMMAND_MODULES`)."""
    _load_subcommand_modules()
    return dict(_REGISTRY)


def _load_subcommand_modules() -> None:
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module)
