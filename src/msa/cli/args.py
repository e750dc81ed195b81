"""Argument parsing for the `msa` command: a parser whose errors are one line, and typed values.

Every bad value is caught at parse time by a type function below, which raises
`argparse.ArgumentTypeError` naming what was expected and what was given; argparse prefixes the
argument (`argument --heads: ...`). `Parser.error` turns that (and every other argparse error)
into `UsageError`, which `msa.cli.main` prints as ONE line, `msa <command>: error: <message>`,
exiting with code 2 — no usage dump, no traceback.

Building the parsers imports neither torch nor the backends (`msa --help` stays fast): the type
functions that need them import them when they run, and the values a parser shows come from
`msa.cli.defaults`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, NoReturn, TypeAlias

import attrs

from msa.cli.defaults import LAYOUT_NAMES
from msa.errors import MSAError, MSAInputError

__all__ = [
    "Parser",
    "Subparsers",
    "UsageError",
    "error_line",
    "positive_int",
    "positive_ints",
    "seed",
    "floats",
    "names",
    "heads",
    "capability",
    "device",
    "layout_head_dim",
    "BenchFile",
    "bench_file",
]


class UsageError(Exception):
    """A bad command line: `prog` ("msa explain") and the message, printed as one line."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message


class Parser(argparse.ArgumentParser):
    """An ArgumentParser (and, through `add_subparsers`, subparsers) whose errors raise
    `UsageError` instead of printing the usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


#: What `Parser.add_subparsers` returns; each command module adds its parser(s) to it.
Subparsers: TypeAlias = "argparse._SubParsersAction[Parser]"


def error_line(prog: str, error: UsageError | MSAError) -> str:
    """`<prog>: error: <message>` on one line (a multi-line message is joined with "; ")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    message = lines[0] + (" " + "; ".join(lines[1:]) if len(lines) > 1 else "") if lines else "failed"
    return f"{prog}: error: {message}"


#: Every count and size msa takes fits int32 (lengths, block ids, rows).
INT32_MAX = 2**31 - 1


def positive_int(text: str) -> int:
    """An integer in [1, 2^31)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"expected a positive integer below 2^31, got {text!r}")
    return value


def seed(text: str) -> int:
    """A random seed, an integer in [-2^63, 2^64) (what torch's `manual_seed` takes)."""
    try:
        value = int(text)
    except ValueError:
        value = 2**64
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [-2^63, 2^64), got {text!r}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """A comma list of integers in [1, 2^31), e.g. 1,16,64."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1 or max(values) > INT32_MAX:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of positive integers below 2^31, e.g. 1,16,64, got {text!r}")
    return values


def floats(text: str) -> tuple[float, ...]:
    """A comma list of numbers, e.g. 0,0.8."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, e.g. 0,0.8, got {text!r}") from None


def names(text: str) -> tuple[str, ...]:
    """A comma list of names (empty entries dropped)."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def heads(text: str) -> tuple[int, int]:
    """`Hq/Hkv`, both positive, whole GQA groups, e.g. 64/4. Both numbers are required: a lone
    `64` could mean 64/1 or 64 query heads over the default KV heads, so it is an error."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if match is None:
        bare = re.fullmatch(r"\s*(\d+)\s*", text)
        if bare is not None:
            raise argparse.ArgumentTypeError(
                f"expected Hq/Hkv, query heads and KV heads such as 64/4, got {text!r}: a lone number is "
                f"ambiguous (write {int(bare[1])}/1 for one KV head)"
            )
        raise argparse.ArgumentTypeError(f"expected Hq/Hkv, two positive integers such as 64/4, got {text!r}")
    if not (1 <= int(match[1]) <= INT32_MAX and 1 <= int(match[2]) <= INT32_MAX):
        raise argparse.ArgumentTypeError(
            f"expected Hq/Hkv, two positive integers below 2^31 such as 64/4, got {text!r}")
    num_q_heads, num_kv_heads = int(match[1]), int(match[2])
    if num_q_heads % num_kv_heads:
        raise argparse.ArgumentTypeError(f"expected Hq/Hkv with Hq a multiple of Hkv, got {text!r}")
    return num_q_heads, num_kv_heads


def capability(text: str) -> tuple[int, int]:
    """A CUDA compute capability MAJOR.MINOR, e.g. 10.0 (MAJOR alone means MAJOR.0)."""
    match = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a compute capability MAJOR.MINOR such as 10.0, got {text!r}")
    return int(match[1]), int(match[2] or 0)


def device(text: str) -> str:
    """auto, cpu, or cuda[:N] — a CUDA device this machine has."""
    if text in ("auto", "cpu"):
        return text
    if not re.fullmatch(r"cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected one of auto, cpu, cuda, cuda:N, got {text!r}")
    import torch

    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"expected auto or cpu: torch finds no CUDA device here, got {text!r}")
    index = torch.device(text).index
    if index is not None and index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"expected a CUDA device index < {torch.cuda.device_count()}, got {text!r}"
        )
    return text


def layout_head_dim(text: str) -> int:
    """A head dim every layout can store (positive; NVFP4 needs a multiple of 32)."""
    value = positive_int(text)
    from msa.layouts import get_layout

    for name in LAYOUT_NAMES:  # each layout checks its own limits (allocating on no device)
        try:
            get_layout(name).allocate(1, 1, 16, value, device="meta")
        except MSAInputError as exc:
            raise argparse.ArgumentTypeError(f"expected {exc.expected}, got {text!r}") from None
        except (RuntimeError, OverflowError):  # (a size no tensor can have)
            raise argparse.ArgumentTypeError(f"expected a head dim a cache can hold, got {text!r}") from None
    return value


@attrs.frozen
class BenchFile:
    """A bench.json written by `msa bench`, read and parsed."""

    path: Path
    data: dict[str, Any]


def bench_file(text: str) -> BenchFile:
    """A readable JSON file holding an object with "rows" (what `msa bench` writes)."""
    path = Path(text)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"expected a bench.json written by msa bench, got {text!r}: {exc.strerror}"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise argparse.ArgumentTypeError(
            f"expected a bench.json written by msa bench, got {text!r}: not JSON ({exc})"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise argparse.ArgumentTypeError(
            f"expected a bench.json written by msa bench (a JSON object with \"rows\"), got {text!r}"
        )
    return BenchFile(path, data)
