"""The serving engines' own decode kernels (vLLM 0.33.0, SGLang 0.5.23), loaded from `.baselines/`
by `benchmarks/engine_baselines`, against msa's reference on msa's benchmark steps.

Skipped where `.baselines/` is absent (CI): `bash benchmarks/engine_baselines/prepare.sh` makes it.

CPU (`TRITON_INTERPRET=1`): small shapes with vLLM's fixed 128-token pages. Triton 3.9's
interpreter cannot run these kernels as they are — it matmuls bfloat16 operands as their raw
16-bit patterns, and splats a scalar comparison (`valid_blk` in vLLM's kernel) into an int32
mask that `tl.load` rejects — so the CPU tests patch those two interpreter methods for their
duration (`interpreter_fixes`), and give SGLang's autotuned kernel one config (the interpreter
cannot benchmark configs; they differ only in warps and stages, which it ignores). SGLang's
Hopper-pinned kernel (`is_sm90`, what an H200 runs) and its generic kernel are both run.

GPU (`gpu` marker): MiniMax-M3 shapes, eager and as a CUDA-graph replay.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import msa
from msa.layouts import get_layout
from msa.problem import MINIMAX_M3_TP
from msa.workload import indexer_topk, make_decode_step

pytest.importorskip("triton")
calls: Any = importlib.import_module("engine_baselines.calls")
load: Any = importlib.import_module("engine_baselines.load")

pytestmark = [
    pytest.mark.skipif(not load.available(), reason="no .baselines/ (run: bash benchmarks/engine_baselines/prepare.sh)"),
    # the interpreter evaluates both sides of the kernels' tl.where guards (e.g. -inf - -inf for
    # the empty split-K chunks), which numpy reports; the GPU computes the same silently
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")

RTOL, ATOL = 2.0**-6, 3e-3
#: small shapes under the interpreter: vLLM's kernel reads pages of exactly 128 tokens
CPU_GEOMETRY = msa.Geometry(8, 2, 64, 128, 4)
ENGINES: dict[str, Callable[..., Any]] = {"vllm": calls.vllm_call, "sglang": calls.sglang_call}
#: (engine, L, SGLang's is_sm90): SGLang's Hopper-pinned kernel (an H200's) and its generic one
CASES = [("vllm", 1, None), ("vllm", 2, None), ("sglang", 1, True), ("sglang", 1, False)]
CASE_IDS = ["vllm-L1", "vllm-L2", "sglang-sm90", "sglang-generic"]


def _facts(hopper: bool | None) -> dict[str, bool]:
    return {} if hopper is None else {"is_sm90": hopper}


@pytest.fixture
def interpreter_fixes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Work around two Triton interpreter bugs (see the module docstring) and SGLang's autotuner."""
    interpreter = importlib.import_module("triton.runtime.interpreter")
    tl = importlib.import_module("triton.language")
    builder = interpreter.InterpreterBuilder
    splat, dot = builder.create_splat, builder.create_dot

    def create_splat(self: Any, ret_ty: Any, arg: Any) -> Any:
        out = splat(self, ret_ty, arg)
        if arg.data.dtype == np.bool_ and out.data.dtype != np.bool_:
            out.data = out.data.astype(np.bool_)
        return out

    def as_float32(handle: Any) -> Any:  # bfloat16 is held as its uint16 bit patterns
        if handle.dtype == tl.bfloat16 and handle.data.dtype == np.uint16:
            return (handle.data.astype(np.uint32) << 16).view(np.float32)
        return handle.data

    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        if tl.bfloat16 not in (a.dtype, b.dtype):
            return dot(self, a, b, d, *args)
        product = np.matmul(as_float32(a), as_float32(b), dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    monkeypatch.setattr(builder, "create_splat", create_splat)
    monkeypatch.setattr(builder, "create_dot", create_dot)
    tuner = load.sglang_module()._gqa_share_sparse_decode_kernel.fn
    monkeypatch.setattr(tuner, "configs", tuner.configs[:1])
    yield


def _step(geometry: msa.Geometry, layout: str, batch: int, length: int, context: int, device: str) -> Any:
    q_dtype = torch.float16 if layout == "float16" else torch.bfloat16
    return make_decode_step(
        geometry, batch_size=batch, decode_query_len=length, context_len=context, kv_cache_dtype=layout,
        q_dtype=q_dtype, device=device, seed=int(torch.randint(2**31, ()).item()),
    )


def _check(out: torch.Tensor, kw: dict[str, Any]) -> None:
    ref = msa.sparse_decode(**kw, backend="reference")
    assert isinstance(ref, torch.Tensor)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=RTOL, atol=ATOL)


@cpu_only
@pytest.mark.usefixtures("interpreter_fixes", "seed")
@pytest.mark.parametrize("engine,length,hopper", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("layout", ["bfloat16", "float16", "fp8_e4m3"])
def test_engine_matches_reference_cpu(engine: str, length: int, layout: str, hopper: bool | None) -> None:
    # 3 requests of up to 700 tokens: 6 blocks, partly visible last pages, one list -1-padded
    step = _step(CPU_GEOMETRY, layout, batch=3, length=length, context=700, device="cpu")
    kw = step.kwargs()
    kw["seq_lens"][2] = 300  # 3 visible blocks < K = 4
    kw["topk_indices"] = indexer_topk(
        kw["seq_lens"], decode_query_len=length, num_kv_heads=CPU_GEOMETRY.num_kv_heads, topk=CPU_GEOMETRY.topk,
        page_size=CPU_GEOMETRY.page_size, max_blocks=kw["block_table"].shape[1],
    )
    assert (kw["topk_indices"] < 0).any()
    call = ENGINES[engine](kw, step.layout)
    assert call is not None
    with load.platform(**_facts(hopper)):  # vLLM: PDL is off under the interpreter
        _check(call(), kw)


@cpu_only
@pytest.mark.usefixtures("interpreter_fixes", "seed")
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_empty_rows_are_nan_in_the_engines(engine: str) -> None:
    """A row that attends nothing (a padding request, `seq_lens = 0`): msa gives zeros, both
    engines NaN. msa's benchmark steps have no such rows."""
    step = _step(CPU_GEOMETRY, "bfloat16", batch=2, length=1, context=300, device="cpu")
    kw = step.kwargs()
    kw["seq_lens"][0] = 0
    kw["topk_indices"] = indexer_topk(
        kw["seq_lens"], decode_query_len=1, num_kv_heads=CPU_GEOMETRY.num_kv_heads, topk=CPU_GEOMETRY.topk,
        page_size=CPU_GEOMETRY.page_size, max_blocks=kw["block_table"].shape[1],
    )
    ref = msa.sparse_decode(**kw, backend="reference")
    assert isinstance(ref, torch.Tensor)
    call = ENGINES[engine](kw, step.layout)
    assert call is not None
    with load.platform(is_sm90=True):
        out = call()
    assert (ref[0] == 0).all() and torch.isnan(out[0]).all()
    torch.testing.assert_close(out[1].float(), ref[1].float(), rtol=RTOL, atol=ATOL)


def test_steps_the_engines_do_not_serve() -> None:
    """NVFP4 caches (both), L > 1 (SGLang), pages other than 128 (vLLM): no call."""
    nvfp4 = _step(msa.Geometry(4, 1, 64, 128, 2), "nvfp4", batch=1, length=1, context=200, device="cpu")
    assert calls.vllm_call(nvfp4.kwargs(), nvfp4.layout) is None
    assert calls.sglang_call(nvfp4.kwargs(), nvfp4.layout) is None
    two = _step(msa.Geometry(4, 1, 64, 128, 2), "bfloat16", batch=1, length=2, context=200, device="cpu")
    assert calls.sglang_call(two.kwargs(), two.layout) is None
    assert calls.vllm_call(two.kwargs(), two.layout) is not None
    small_pages = _step(msa.Geometry(4, 1, 64, 32, 2), "bfloat16", batch=1, length=1, context=200, device="cpu")
    assert calls.vllm_call(small_pages.kwargs(), small_pages.layout) is None
    assert calls.sglang_call(small_pages.kwargs(), small_pages.layout) is not None
    assert get_layout("nvfp4").block_scaled


def test_loading_leaves_sys_modules_alone() -> None:
    before = {name for name in sys.modules if name.split(".")[0] in ("vllm", "sglang")}
    assert load.vllm_decode.__name__ == "minimax_m3_sparse_attn_decode"
    assert load.sglang_decode.__name__ == "flash_decode_with_gqa_share_sparse"
    after = {name for name in sys.modules if name.split(".")[0] in ("vllm", "sglang")}
    assert after == before


def _graph_replay(call: Callable[[], torch.Tensor]) -> torch.Tensor:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.gpu
@pytest.mark.usefixtures("seed")
@pytest.mark.parametrize("engine,length,hopper", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("tp,batch", [(1, 1), (1, 48), (4, 16)])
def test_engine_matches_reference_gpu(tp: int, batch: int, layout: str, engine: str, length: int,
                                      hopper: bool | None) -> None:
    """MiniMax-M3 shapes (TP1: 64/4 heads, TP4: 16/1; D 128, P 128, K 16), 8K-token contexts,
    as `msa bench` runs them: eager, then captured once and replayed. vLLM with the stub's own
    platform facts (PDL on sm90+)."""
    step = _step(MINIMAX_M3_TP[tp], layout, batch=batch, length=length, context=8192, device="cuda")
    kw = step.kwargs()
    call = ENGINES[engine](kw, step.layout)
    assert call is not None
    with load.platform(**_facts(hopper)):
        _check(call(), kw)
        _check(_graph_replay(call), kw)
