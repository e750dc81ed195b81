"""`msa layouts` and `msa version`: what this installation offers (torch and the layouts are
imported by the commands, not by their parsers)."""

from __future__ import annotations

import argparse

from msa.cli.args import Subparsers, layout_head_dim
from msa.cli.defaults import M3_HEAD_DIM

__all__ = ["add_parsers", "run_layouts", "run_version"]


def add_parsers(subparsers: Subparsers) -> None:
    layouts = subparsers.add_parser("layouts", help="list the KV-cache layouts and their sizes")
    layouts.add_argument(
        "--head-dim", type=layout_head_dim, default=M3_HEAD_DIM,
        help="D (every layout must store it; default %(default)s)",
    )
    layouts.set_defaults(func=run_layouts)
    version = subparsers.add_parser("version", help="versions of msa, torch and the device")
    version.set_defaults(func=run_version)


def run_layouts(args: argparse.Namespace) -> int:
    from msa.display import format_table
    from msa.layouts import LAYOUT_NAMES, get_layout

    rows = []
    for name in LAYOUT_NAMES:
        layout = get_layout(name)
        shape = layout.cache_shape(1, 1, 1, args.head_dim)
        rows.append(
            [
                name,
                layout.name,
                str(layout.storage_dtype).removeprefix("torch."),
                "[pages, " + ("2*Hkv" if shape[1] == 2 else "Hkv") + f", P, {shape[-1]}]",
                layout.bytes_per_token(args.head_dim),
            ]
        )
    print(
        format_table(
            ["kv_cache_dtype", "layout", "storage", f"cache (D={args.head_dim})", "bytes/token/head"],
            rows,
        )
    )
    return 0


def run_version(args: argparse.Namespace) -> int:
    import torch

    from msa import __version__
    from msa.api import available_backends

    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"msa {__version__}, torch {torch.__version__}, CUDA device: {cuda}")
    print("backends: " + ", ".join(b.name for b in available_backends()))
    return 0
