"""The top-level ``argparse`` parser, whose errors are one line (no usage block) and never exit directly."""

from __future__ import annotations

import argparse

from ..schema.sizes import BYTE_SIZE_FORMS
from ..schema.version import __version__
from .registry import registered_subcommands

__all__ = ["PROG", "UsageError", "one_line", "build_parser"]

PROG = "ninfer-kv"


class UsageError(Exception):
    """A bad command line or a bad value: reported as one line on stderr, exit status 2."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog
        self.message = message

    def line(self) -> str:
        """The whole report: ``PROG: error: MESSAGE`` with the message folded onto one line."""
        return f"{self.prog}: error: {one_line(self.message)}"


def one_line(message: object) -> str:
    """``message`` as text with every run of whitespace (newlines included) folded to one space."""
    return " ".join(str(message).split())


class _Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are a single line (no usage block) and never exit directly."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(self.prog, message)


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per registered subcommand."""
    parser = _Parser(
        prog=PROG,
        description="Plan and inspect ninfer_kv's growing paged KV cache.",
        epilog=f"Byte sizes accept {BYTE_SIZE_FORMS}.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in registered_subcommands().values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        _add_common_arguments(p)
        p.set_defaults(_subcommand=cmd, _parser=p)
    return parser
