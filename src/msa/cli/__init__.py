"""The `msa` command.

A bad flag, or any msa error (`MSAError`) a command raises, ends in ONE line on stderr,
`msa <command>: error: <message>`, and exit code 2 (see `msa.cli.args`); help exits 0.

Building the parser imports neither torch, triton nor the backends: each command imports what it
needs when it runs, so `msa --help` and a bad flag answer at once (tests/test_cli_imports.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from msa.cli import backends, bench, demo, info
from msa.cli.args import Parser, UsageError, error_line
from msa.errors import MSAError

__all__ = ["main", "build_parser"]


def build_parser() -> Parser:
    parser = Parser(
        prog="msa",
        description="Sparse attention decode over a paged KV cache (MiniMax Sparse Attention).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo.add_parser(subparsers)
    info.add_parsers(subparsers)
    backends.add_parsers(subparsers)
    bench.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `msa` console script: the command's exit code (2 for an error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(error_line(exc.prog, exc), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        result: int = args.func(args)
    except MSAError as exc:
        print(error_line(f"msa {args.command}", exc), file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
