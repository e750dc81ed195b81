"""The plugin that registers msa's own backends, through the same hook third parties use."""

from __future__ import annotations

from msa.hooks import BackendRecord, hookimpl


@hookimpl
def msa_backends() -> list[BackendRecord]:
    from msa.backends.cute import CuteBackend
    from msa.backends.cutlass_sm100 import CutlassSM100Backend
    from msa.backends.flashinfer import FlashInferBackend
    from msa.backends.reference import ReferenceBackend
    from msa.backends.triton import TritonBackend

    return [
        BackendRecord(
            name="cutlass_sm100",
            factory=CutlassSM100Backend,
            priority=300,
            aliases=("cutlass",),
            description=CutlassSM100Backend.description,
        ),
        BackendRecord(
            name="flashinfer",
            factory=FlashInferBackend,
            priority=200,
            description=FlashInferBackend.description,
        ),
        BackendRecord(
            name="cute",
            factory=CuteBackend,
            priority=150,
            description=CuteBackend.description,
        ),
        BackendRecord(
            name="triton",
            factory=TritonBackend,
            priority=100,
            description=TritonBackend.description,
        ),
        BackendRecord(
            name="reference",
            factory=ReferenceBackend,
            priority=0,
            description=ReferenceBackend.description,
        ),
    ]
