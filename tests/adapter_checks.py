"""Checks shared by the adapter tests against stand-ins (test_adapters.py) and against the real
libraries' Python code (conformance/)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import msa
import msa.backends.external as external
import msa.backends.flashinfer


def assert_matches_reference(out: torch.Tensor, kw: dict[str, Any], lse: torch.Tensor | None = None) -> None:
    """`out` (and `lse`) equal the reference backend's result for the step `kw`, and every row
    was written (outputs are poisoned with NaN before the kernel runs)."""
    plain = dict(kw, q=kw["q"].as_subclass(torch.Tensor))  # a library's tensor subclass, if any
    ref_out, ref_lse = msa.sparse_decode(**plain, backend="reference", return_lse=True)
    assert not torch.isnan(out).any(), "rows the kernel never wrote"
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-7, atol=2e-3)
    if lse is not None:
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-4)


def pretend_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapters see a capturing CUDA stream (what they ask before any host read)."""
    monkeypatch.setattr(external, "stream_capturing", lambda device: True)
    monkeypatch.setattr(msa.backends.flashinfer, "stream_capturing", lambda device: True)
