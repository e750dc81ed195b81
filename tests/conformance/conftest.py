"""Fixtures of the conformance tests (see harness.py): `fmha` and `flashinfer`."""

from harness import flashinfer, fmha

__all__ = ["flashinfer", "fmha"]
