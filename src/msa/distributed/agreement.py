"""Errors raised on every rank alike: the group agrees on each rank's local checks before any
collective whose shapes come from the inputs.

A distributed step is a sequence of collectives. A rank that raises before them leaves the others
waiting in the first one until the group's timeout (or, where the shapes differ, makes a
collective of mismatched sizes, which aborts the process). So every rank runs its local checks
(and its local decode) inside a guard that captures the error, then makes ONE fixed-size
collective, `agree`: an all-gather of `1 + FACTS` int64 per rank — a status code and the facts
the later collectives' shapes depend on (rows, heads, head dim, dtype, method, ...). Its size
depends on nothing the caller passes, so it can neither hang nor abort on a bad input. Then:

- a rank failed: a second fixed-size all-gather (`MESSAGE_BYTES` per rank, only on this error
  path) carries each failing rank's error; the failing rank raises its own error, every other
  rank an error of the same kind naming the failing rank and its message (`MSAInputError` naming
  the same argument, `MSAUnsupportedError`, or `RuntimeError` for anything else);
- the facts differ between ranks: every rank raises the same `MSAInputError` naming the argument
  and each rank's value;
- otherwise the step goes on, its shapes known to agree.

The agreement reads the result on the host. It runs on the CPU where the group has a CPU backend
(gloo), else on the inputs' device (one synchronisation). Inside CUDA-graph capture nothing can be
read on the host: there `agree` raises a local error on its own rank only and makes no collective
(the one-shot forms; the planner's `run` agrees only with `validate=True`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs
import torch
import torch.distributed as dist

from msa.distributed.group import GroupInfo, all_gather_into
from msa.errors import MSAInputError, MSAUnsupportedError

__all__ = ["Fact", "agree", "dtype_code", "name_code", "dims", "CALLS", "FACTS", "MESSAGE_BYTES"]

#: int64 slots for the facts of one call (after the status and the call's code).
FACTS = 16
#: Bytes per rank for the error messages (the error path only).
MESSAGE_BYTES = 1024

#: The collective calls that agree (a rank in another call than the others is an error too).
CALLS = ("msa.distributed.sparse_decode", "merge_partials", "merge_partials_scattered",
         "DistributedDecodePlanner.run")

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float64, torch.int32,
           torch.int64, torch.uint8, torch.int8)
_DTYPE_NAMES = tuple(str(d) for d in _DTYPES)

_OK, _INPUT, _UNSUPPORTED, _OTHER = 0, 1, 2, 3


@attrs.frozen
class Fact:
    """One value every rank must pass alike.

    Attributes:
        argument: the argument it comes from (named by the error).
        what: what it is ("row count", "dtype", ...).
        value: its code (-1: not available, e.g. the argument is not a tensor).
        names: the names of the codes, for the message (empty: the codes are the values).
    """

    argument: str
    what: str
    value: int
    names: tuple[str, ...] = ()

    def show(self, value: int) -> str:
        if value == -1:
            return "n/a"
        if self.names:
            return self.names[value] if 0 <= value < len(self.names) else "another value"
        return str(value)


def dtype_code(value: object) -> tuple[int, tuple[str, ...]]:
    """(code, names) of a dtype (or of a tensor's dtype) for a `Fact`; None is "None"."""
    if isinstance(value, torch.Tensor):
        value = value.dtype
    names = ("None", *_DTYPE_NAMES)
    if value is None:
        return 0, names
    return (_DTYPES.index(value) + 1 if value in _DTYPES else len(names)), names


def name_code(value: object, names: Sequence[str]) -> tuple[int, tuple[str, ...]]:
    """(code, names) of one of `names` (another value gets a code past them)."""
    known = tuple(names)
    return (known.index(value) if isinstance(value, str) and value in known else len(known)), known


def dims(value: object, count: int) -> list[int]:
    """The sizes of a `count`-D tensor, or -1s (anything else: the local checks report it)."""
    if isinstance(value, torch.Tensor) and value.dim() == count:
        return [int(s) for s in value.shape]
    return [-1] * count


def _device(info: GroupInfo, device: torch.device | None) -> torch.device:
    """Where the agreement's tensors live: the CPU where the group can reduce CPU tensors."""
    try:
        backend = str(dist.get_backend(info.group)).lower()
    except Exception:  # noqa: BLE001 - a group type without a backend name
        backend = ""
    if "gloo" in backend or (device is not None and device.type == "cpu"):
        return torch.device("cpu")
    if device is not None:
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def capturing() -> bool:
    """True inside CUDA-graph capture on the current stream (no host reads there)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _status(error: BaseException | None) -> int:
    if error is None:
        return _OK
    if isinstance(error, MSAInputError):
        return _INPUT
    if isinstance(error, MSAUnsupportedError):
        return _UNSUPPORTED
    return _OTHER


def _encode(error: BaseException | None) -> bytes:
    if error is None:
        return b""
    text = str(error)
    argument = error.argument if isinstance(error, MSAInputError) else ""
    for keep in (700, 300, 100, 0):
        payload = json.dumps({"type": type(error).__name__, "argument": argument[:100],
                              "message": text[:keep] + ("..." if len(text) > keep else "")}).encode()
        if len(payload) <= MESSAGE_BYTES:
            return payload
    return b""


def _decode(raw: bytes) -> dict[str, str]:
    try:
        found = json.loads(raw.rstrip(b"\0").decode("utf-8", errors="replace"))
        if isinstance(found, dict):
            return {k: str(v) for k, v in found.items()}
    except ValueError:
        pass
    return {"type": "?", "argument": "", "message": raw.rstrip(b"\0").decode("utf-8", errors="replace")}


def _messages(info: GroupInfo, error: BaseException | None, device: torch.device) -> list[dict[str, str]]:
    """Every rank's error, through one fixed-size all-gather (the error path only)."""
    payload = _encode(error)
    mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    seen = torch.empty((info.world_size, MESSAGE_BYTES), dtype=torch.uint8, device=device)
    all_gather_into(seen, mine.to(device), info.group)
    return [_decode(bytes(row)) for row in seen.cpu().tolist()]


def agree(info: GroupInfo, call: str, facts: Sequence[Fact], error: BaseException | None,
          device: torch.device | None) -> list[list[int]]:
    """The group's agreement on this rank's local checks (a collective of fixed size).

    Args:
        info: the group.
        call: which call this is (one of `CALLS`).
        facts: at most `FACTS` values every rank must pass alike, in the same order on every rank.
        error: what this rank's local checks raised (None: they passed).
        device: the inputs' device, if known (where the agreement runs on NCCL groups).

    Returns:
        Every rank's facts' values, `[W][len(facts)]`.

    Raises:
        `error` on the rank that raised it; on the other ranks an error naming that rank (see
        the module docstring); `MSAInputError` on every rank when the facts differ.
    """
    assert len(facts) <= FACTS and call in CALLS
    if capturing():  # no host reads inside graph capture: the local error stays local
        if error is not None:
            raise error
        return [[f.value for f in facts]] * info.world_size
    where = _device(info, device)
    row = [_status(error), CALLS.index(call), *(f.value for f in facts), *([0] * (FACTS - len(facts)))]
    seen = torch.empty((info.world_size, len(row)), dtype=torch.int64, device=where)
    all_gather_into(seen, torch.tensor(row, dtype=torch.int64).to(where), info.group)
    table: list[list[int]] = seen.cpu().tolist()
    failed = [r for r, got in enumerate(table) if got[0] != _OK]
    if failed:
        messages = _messages(info, error, where)
        if error is not None:
            raise error
        first = failed[0]
        also = f" (ranks {', '.join(map(str, failed))} failed)" if len(failed) > 1 else ""
        found = messages[first]
        given = f"an error on rank {first} of the group{also}: {found.get('message', '')}"
        status = table[first][0]
        if status == _INPUT:
            raise MSAInputError(
                found.get("argument") or "group",
                "inputs every rank of the group accepts (the step is a collective: an error found on one rank "
                "is raised on every rank)", given,
            )
        if status == _UNSUPPORTED:
            raise MSAUnsupportedError(f"rank {first} of the group cannot run this step{also}: "
                                      f"{found.get('message', '')}")
        raise RuntimeError(f"rank {first} of the group failed{also}: {found.get('type', '?')}: "
                           f"{found.get('message', '')}")
    calls = [got[1] for got in table]
    if len(set(calls)) > 1:
        raise MSAInputError(
            "group", "the same msa.distributed call on every rank of the group at once",
            ", ".join(f"rank {r}: {CALLS[c] if 0 <= c < len(CALLS) else c}" for r, c in enumerate(calls)),
        )
    values = [got[2 : 2 + len(facts)] for got in table]
    for i, fact in enumerate(facts):
        column = [v[i] for v in values]
        if len(set(column)) > 1:
            raise MSAInputError(
                fact.argument, f"the same {fact.what} on every rank of the group",
                ", ".join(f"rank {r}: {fact.show(v)}" for r, v in enumerate(column)),
            )
    return values
