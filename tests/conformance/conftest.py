"""Fixtures of the conformance tests (see harness.py): `fmha`, `flashinfer` and `vllm_m3`."""

from harness import flashinfer, fmha, vllm_m3

__all__ = ["flashinfer", "fmha", "vllm_m3"]
