"""`msa.bench.timing.Timer`: its L2 flush choice, checked before any GPU memory is touched, and
what each flush does to its buffer on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from msa.bench.timing import FLUSHES, Timer
from msa.errors import MSAInputError


@pytest.mark.parametrize("flush", ["", "WRITE", "none", "zero"])
def test_an_unknown_flush_is_refused_by_name(flush: str) -> None:
    with pytest.raises(MSAInputError, match="flush: .*write, read") as caught:
        Timer(reps=2, flush=flush)
    assert caught.value.argument == "flush" and caught.value.given == repr(flush)


@pytest.mark.gpu
@pytest.mark.parametrize("flush", FLUSHES)
def test_each_flush_times_every_repetition_and_touches_its_buffer_as_named(flush: str) -> None:
    """`eager` calls the callable warmup + reps times and gives a positive median; "write"
    leaves the 512 MB buffer zeroed, "read" leaves what it held (a sum only reads it)."""
    timer = Timer(reps=4, warmup=2, flush=flush)
    timer._buffer.fill_(7)
    calls = []
    a = torch.randn(1 << 20, device="cuda")
    micros = timer.eager(lambda: calls.append(a.mul_(1.0)))
    assert len(calls) == 6 and math.isfinite(micros) and micros > 0
    held = int(timer._buffer[:: 1 << 20].sum().item())
    assert held == (0 if flush == "write" else 7 * timer._buffer[:: 1 << 20].numel())
