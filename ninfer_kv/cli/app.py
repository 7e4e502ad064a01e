"""The entry point :func:`main`: parse, run the subcommand, print its output or a one-line error."""

from __future__ import annotations

import json
import sys
from typing import Sequence

from .flags import speak_in_flags
from .parser import PROG, UsageError, build_parser, one_line
from .registry import Subcommand, registered_subcommands

__all__ = ["EXIT_USAGE", "EXIT_INTERNAL", "EXIT_CHECK_FAILED", "main"]

EXIT_USAGE = 2
EXIT_INTERNAL = 1
EXIT_CHECK_FAILED = 3
"""The command ran and printed its result, but a check it made failed (the demo's dense check)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 success, 2 bad usage or bad value, 1 internal error,
    3 a check the command made failed, after printing its result).

    No traceback is printed: a bad value is one line on stderr naming the flag, the value and the
    allowed range; an unexpected failure is one line too (set ``NINFER_KV_TRACEBACK=1`` to see it).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: Subcommand | None = None
    try:
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            cmd = getattr(args, "_subcommand", None)
            if cmd is None:
                names = ", ".join(registered_subcommands())
                raise UsageError(PROG, f"a command is required (choose from {names}); see {PROG} --help")
            try:
                result = cmd.run(args)
            except ValueError as exc:
                message = speak_in_flags(str(exc), args._parser, argv)
                raise UsageError(f"{PROG} {cmd.name}", message) from None
        except UsageError as exc:
            print(exc.line(), file=sys.stderr)
            return EXIT_USAGE
        if result is not None:
            if args.json:
                sys.stdout.write(json.dumps(result.data) + "\n")
            else:
                sys.stdout.write(result.text.rstrip("\n") + "\n")
            return result.exit_code
        return 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``ninfer-kv plan ... | head``): stop quietly
        import os

        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (AttributeError, OSError, ValueError):
            pass
        return 0
    except Exception as exc:  # noqa: BLE001 - the command line never prints a traceback
        import os

        if os.environ.get("NINFER_KV_TRACEBACK"):
            raise
        where = f"{PROG} {cmd.name}" if cmd is not None else PROG
        print(
            f"{where}: internal error: {type(exc).__name__}: {one_line(exc)} (set NINFER_KV_TRACEBACK=1 for details)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
