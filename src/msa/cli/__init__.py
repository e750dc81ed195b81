"""The `msa` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from msa.cli import backends, bench, demo, info

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    """Entry point of the `msa` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
