"""The ``ninfer-kv`` command line.

Usage::

    ninfer-kv layout --profile k8v4 --head-dim 256 [--layers 16 --kv-heads 2 [--order page-major] [--pages 8]] [--json]
    ninfer-kv plan --layers 16 --kv-heads 2 --head-dim 256 --profile k8v4 \\
        --max-context 32768 --max-concurrency 64 --free-bytes 40GiB --speculative mtp --draft-window 4 [--json]
    ninfer-kv generate --model DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S]

Output contract:

* Default output is human-readable text.  With ``--json`` exactly one JSON object is written to
  stdout and nothing else.
* Bad values exit with status 2 and a single line on stderr that names the flag (``--max-context``,
  never the library's ``max_context``), the value and the allowed range, and says when the value is
  a default the user did not type.  No traceback is ever printed: an unexpected failure is one line
  and exit status 1 (``NINFER_KV_TRACEBACK=1`` shows the traceback).
* ``--kv-cache-dtype`` is an alias of ``--profile``; both accept the profile names and the short
  names of :data:`ninfer_kv.schema.profiles.PROFILE_ALIASES` (``fp8``, ``int8``, ``nvfp4``, ...), exactly
  as Python's ``KVProfile.parse`` does.  Byte sizes are read by :func:`ninfer_kv.schema.sizes.parse_bytes`,
  the syntax every Python byte-count argument accepts too.

Subcommands live in a registry.  A module adds one with :func:`register_subcommand` (usually as a
decorator on its ``run`` function) and is listed in :data:`SUBCOMMAND_MODULES` so ``main`` imports it
before building the parser::

    from ninfer_kv.cli import CommandOutput, register_subcommand

    def _configure(parser):
        parser.add_argument("--steps", type=int, default=10)

    @register_subcommand("demo", help="run a small decode loop", configure=_configure)
    def _run(args) -> CommandOutput:
        ...
        return CommandOutput(data={"steps": args.steps}, text=f"ran {args.steps} steps")

``run`` receives the parsed namespace and returns a :class:`CommandOutput` (rendered as text or as
JSON by ``--json``) or ``None`` when it has written its own output.  A ``ValueError`` raised by
``run`` is reported as a usage error (exit 2, one line).

Modules: :mod:`.registry` (the subcommand registry and :data:`SUBCOMMAND_MODULES`, where the
``demo`` command of :mod:`ninfer_kv.demo.cli` is hooked in), :mod:`.types` (argparse ``type=``
callables), :mod:`.parser` (the one-line-error parser), :mod:`.flags` (library parameter names
spoken as flags), :mod:`.tables` (text tables), :mod:`.layout_cmd`, :mod:`.plan_cmd` and :mod:`.generate_cmd` (the
built-in commands, registered when this package is imported) and :mod:`.app` (:func:`main`).
"""

from __future__ import annotations

import sys
import types as _module_types

from . import layout_cmd, plan_cmd, generate_cmd  # noqa: F401  (the built-in commands; importing registers them, in this order)
from . import registry as _registry
from .app import main
from .parser import build_parser
from .registry import (
    SUBCOMMAND_MODULES,
    CommandOutput,
    Subcommand,
    register_subcommand,
    registered_subcommands,
)
from .tables import render_table
from .types import bounded_int

# Also importable from here, outside ``__all__``: the argparse types other commands declare their
# flags with (``ninfer_kv.demo.cli``), and the names of the error contract.
from .app import EXIT_INTERNAL, EXIT_USAGE  # noqa: F401
from .flags import PARAMETER_FLAGS  # noqa: F401
from .parser import PROG, UsageError  # noqa: F401
from .types import (  # noqa: F401
    SPECULATIVE,
    BYTES,
    KV_CACHE_DTYPES,
    NON_NEGATIVE_INT,
    ORDER,
    POSITIVE_INT,
    PROFILE,
    PROFILE_HELP,
)

__all__ = [
    "CommandOutput",
    "Subcommand",
    "SUBCOMMAND_MODULES",
    "register_subcommand",
    "registered_subcommands",
    "build_parser",
    "bounded_int",
    "render_table",
    "main",
]


class _CLIModule(_module_types.ModuleType):
    """This package's module type: ``ninfer_kv.cli._REGISTRY`` is the registry's own table.

    Reading it reads :mod:`.registry`'s table and assigning it swaps that table, so a test that
    replaces ``ninfer_kv.cli._REGISTRY`` with a copy (``monkeypatch.setattr``) registers into the
    copy and leaves the real registry as it was.
    """

    @property
    def _REGISTRY(self) -> dict[str, Subcommand]:
        return _registry._REGISTRY

    @_REGISTRY.setter
    def _REGISTRY(self, table: dict[str, Subcommand]) -> None:
        _registry._REGISTRY = table


sys.modules[__name__].__class__ = _CLIModule
