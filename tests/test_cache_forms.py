"""The engines' cache forms: a packed cache, separate contiguous K and V (FlashInfer's) and
SGLang's token pools viewed as pages hold the same bytes, and every backend that reads them gives
identical results; writers, dequantize and validation take the pair form too."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import msa
from msa.backends.triton import TritonBackend
from msa.layouts import get_layout
from msa.validation import check_decode_inputs
from msa.workload import KV_FORMS, as_kv_form, make_decode_step

INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
SPLIT_LAYOUTS = ("bfloat16", "float16", "fp8_e4m3")
GEOMETRY = msa.Geometry(8, 2, 64, 16, 4)


def _step(layout: str, seed: int, device: str = "cpu", length: int = 2) -> Any:
    return make_decode_step(GEOMETRY, batch_size=3, decode_query_len=length, context_len=90, kv_cache_dtype=layout,
                            q_dtype=torch.float16 if layout == "float16" else torch.bfloat16, device=device, seed=seed)


def test_forms_hold_the_same_bytes(seed: int) -> None:
    for layout in SPLIT_LAYOUTS:
        step = _step(layout, seed)
        lay = get_layout(layout)
        keys, values = lay.kv_views(step.kv_cache)
        for form in KV_FORMS:
            k, v = lay.kv_views(as_kv_form(lay, step.kv_cache, form))
            assert k.shape == keys.shape and torch.equal(k.view(torch.uint8), keys.view(torch.uint8))
            assert torch.equal(v.view(torch.uint8), values.view(torch.uint8))
        pools = as_kv_form(lay, step.kv_cache, "sglang")
        pages, heads, p, d = keys.shape
        assert pools[0].stride() == (p * heads * d, d, heads * d, 1), "SGLang's token-major pool, viewed as pages"


def _run(backend: str, kw: dict[str, Any], **extra: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = msa.sparse_decode(**kw, backend=backend, return_lse=True, **extra)
    return out, lse


@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
def test_every_form_gives_the_reference_result(layout: str, seed: int) -> None:
    step = _step(layout, seed)
    base = _run("reference", step.kwargs())
    for form in KV_FORMS[1:]:
        kw = dict(step.kwargs(), kv_cache=as_kv_form(step.layout, step.kv_cache, form))
        out, lse = _run("reference", kw, validate=True)
        assert torch.equal(out, base[0]) and torch.equal(lse, base[1]), form


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
@pytest.mark.parametrize("splits, dedup", [(1, False), (3, False), (2, True)])
def test_triton_reads_every_form_identically(layout: str, splits: int, dedup: bool, seed: int) -> None:
    """The packed cache is the special case of one reader: identical bits in every form."""
    step = _step(layout, seed, DEVICE, length=3)
    results = []
    for form in KV_FORMS:
        kw = dict(step.kwargs(), kv_cache=as_kv_form(step.layout, step.kv_cache, form))
        problem, inputs = check_decode_inputs(**kw, return_lse=True)
        out = torch.full(kw["q"].shape, float("nan"), dtype=problem.out_dtype, device=DEVICE)
        lse = torch.full(kw["q"].shape[:2], float("nan"), device=DEVICE)
        TritonBackend(num_splits=splits, dedup=dedup).run_step(problem, inputs, out, lse)
        results.append((out, lse))
    ref_out, ref_lse = _run("reference", step.kwargs())
    torch.testing.assert_close(results[0][0].float(), ref_out.float(), rtol=2**-7, atol=3e-3)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_planner_runs_a_pair(seed: int) -> None:
    step = _step("fp8_e4m3", seed)
    pair = as_kv_form(step.layout, step.kv_cache, "separate")
    planner = msa.DecodePlanner(GEOMETRY, kv_cache_dtype="fp8", backend="reference", device="cpu")
    plan = planner.plan(step.block_table, step.seq_lens, decode_query_len=2)
    out = torch.empty(step.q.shape, dtype=torch.bfloat16)
    planner.run(plan, step.q, pair, step.topk_indices, out=out, k_scale=step.k_scale, v_scale=step.v_scale)
    assert torch.equal(out, msa.sparse_decode(**step.kwargs(), backend="reference"))


@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
@pytest.mark.parametrize("kernel", [False, True])
def test_writers_and_dequantize_take_a_pair(layout: str, kernel: bool, gen: torch.Generator) -> None:
    if kernel and not INTERPRET:
        pytest.skip("the Triton writer runs on the CPU only under TRITON_INTERPRET=1")
    if kernel and layout == "fp8_e4m3":
        pytest.skip("the interpreter rounds fp32 -> fp8 wrongly: the fp8 Triton writer is compared on the GPU")
    lay = get_layout(layout)
    packed = lay.allocate(5, 2, 16, 64)
    pair = lay.allocate(5, 2, 16, 64, separate=True)
    sglang = as_kv_form(lay, lay.allocate(5, 2, 16, 64), "sglang")
    dtype = torch.float16 if layout == "float16" else torch.bfloat16
    key = torch.randn((40, 2, 64), generator=gen).to(dtype)
    value = torch.randn((40, 2, 64), generator=gen).to(dtype)
    slots = torch.randperm(80, generator=gen)[:40]
    slots[::7] = -1
    scale = 0.05 if layout == "fp8_e4m3" else None
    for cache in (packed, pair, sglang):
        lay.write(cache, key, value, slots, k_scale=scale, v_scale=scale, kernel=kernel)
    k0, v0 = lay.kv_views(packed)
    for cache in (pair, sglang):
        k, v = lay.kv_views(cache)
        assert torch.equal(k.view(torch.uint8), k0.view(torch.uint8)) and torch.equal(v.view(torch.uint8), v0.view(torch.uint8))
        dk, dv = lay.dequantize(cache, k_scale=0.05, v_scale=0.05)
        rk, rv = lay.dequantize(packed, k_scale=0.05, v_scale=0.05)
        assert torch.equal(dk, rk) and torch.equal(dv, rv)


def test_pair_validation() -> None:
    step = _step("bfloat16", 1)
    kw = step.kwargs()
    k, v = as_kv_form(step.layout, step.kv_cache, "separate")
    cases = [
        ((k, v, v), r"^kv_cache: expected a \(k_cache, v_cache\) pair, got a tuple of 3"),
        ((k, v[:2]), r"^kv_cache\[1\] \(v_cache\): expected the shape, dtype and device of k_cache"),
        ((k, v.half()), r"^kv_cache\[1\] \(v_cache\): expected dtype torch.bfloat16 for the 'bfloat16' layout"),
        ((k, "v"), r"^kv_cache\[1\] \(v_cache\): expected a torch.Tensor, got str"),
        ((k, v.transpose(2, 3)), r"^kv_cache\[1\] \(v_cache\): expected unit stride in the last dimension"),
        ((k[..., 0], v[..., 0]), r"^kv_cache\[0\] \(k_cache\): expected a 4-D tensor \[pages, Hkv, P, D\]"),
    ]
    for cache, match in cases:
        with pytest.raises(msa.MSAInputError, match=match):
            msa.sparse_decode(**dict(kw, kv_cache=cache))
    nvfp4 = get_layout("nvfp4")
    with pytest.raises(msa.MSAInputError, match=r"^kv_cache: expected one tensor .* for the 'nvfp4' layout, got a tuple"):
        nvfp4.inspect((k, v))
    with pytest.raises(msa.MSAInputError, match=r"^separate: expected False for the 'nvfp4' layout"):
        nvfp4.allocate(2, 1, 16, 64, separate=True)
