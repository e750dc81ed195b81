"""Readable terminal output: aligned tables and a progress line."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TextIO, TypeVar

__all__ = ["format_table", "progress"]

T = TypeVar("T")


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """An aligned plain-text table; numbers right-aligned (with "-" for a missing one), text
    left-aligned."""
    body = [[_cell(v) for v in row] for row in rows]
    numeric = [  # "-" marks a missing number
        any(_is_number(row[i]) for row in body if i < len(row))
        and all(_is_number(row[i]) or row[i] == "-" for row in body if i < len(row))
        for i in range(len(headers))
    ]
    widths = [
        max([len(h)] + [len(row[i]) for row in body if i < len(row)]) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=False)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(row) for row in body])


def _cell(value: object) -> str:
    if isinstance(value, float):
        if value == 0.0:
            return "0"
        if abs(value) >= 1e4 or abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.3f}"
    return " ".join(str(value).splitlines())  # (a line break inside a cell, e.g. a plugin's text, would split its row)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def progress(items: Sequence[T], label: str, stream: TextIO | None = None) -> Iterator[T]:
    """Yield `items`, showing `[i/n] label item (elapsed)` on `stream` (stderr by default).

    On a terminal the line is redrawn in place; elsewhere each step gets its own line.
    """
    out = stream if stream is not None else sys.stderr
    tty = out.isatty()
    start = time.perf_counter()
    total = len(items)
    for i, item in enumerate(items, 1):
        text = f"[{i}/{total}] {label} {item} ({time.perf_counter() - start:.1f}s)"
        out.write(("\r\x1b[K" + text) if tty else text + "\n")
        out.flush()
        yield item
    if tty:
        out.write("\r\x1b[K")
        out.flush()
