"""Fuzz: malformed-but-legal steps with every unread byte poisoned with NaN (tests/hostile.py),
through the reference, the Triton kernels (interpreter on the CPU) and the dense oracle, each
compared with the independent float64 loop.

Bounded for CI (`MSA_FUZZ_EXAMPLES`, default 12 per test); a failure prints the seed and the
parameters — replay one with `make_hostile(params, seed)`.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from cases import assert_close_to_naive, gpu_atol
from hostile import LAYOUTS, Hostile, make_hostile
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import msa
from msa.backends.triton import TritonBackend
from msa.oracle import dense_masked_attention
from msa.validation import check_decode_inputs

EXAMPLES = int(os.environ.get("MSA_FUZZ_EXAMPLES", "12"))
INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
# no shrinking: an example takes seconds under the interpreter, and the failure message already
# names the seed and every parameter
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def step_params(draw: st.DrawFn, max_batch: int = 3, layouts: tuple[str, ...] = LAYOUTS, head_dim: int = 64,
                groups: tuple[int, ...] = (1, 2, 4, 16), pages: tuple[int, ...] = (16, 32), max_topk: int = 5,
                max_blocks: int = 5) -> dict[str, Any]:
    """Hostile-step parameters (`make_hostile`); the defaults keep an interpreter run short."""
    layout = draw(st.sampled_from(layouts))
    return {
        "layout": layout,
        "batch": draw(st.integers(0, max_batch)),
        "query_len": draw(st.integers(1, 4)),
        "num_kv_heads": draw(st.sampled_from([1, 2])),
        "group": draw(st.sampled_from(groups)),
        "head_dim": head_dim,
        "page_size": draw(st.sampled_from(pages)),
        "topk": draw(st.integers(1, max_topk)),
        "max_blocks": draw(st.integers(1, max_blocks)),
        "ragged": draw(st.booleans()),
        "token_major": draw(st.booleans()),
        "tensor_scales": draw(st.booleans()),
        "table_pad": draw(st.integers(0, 2)),
        "q_fp8": draw(st.booleans()) and layout != "float16",
    }


SEEDS = st.integers(0, 2**31 - 1)


def _outputs(hostile: Hostile, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    q = hostile.kwargs["q"]
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=device)
    lse = torch.full(q.shape[:2], float("nan"), device=device)
    return out, lse


def run_triton(hostile: Hostile, backend: TritonBackend, lse_wanted: bool = True, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plan and run the Triton backend directly (to force splits and strategies)."""
    kw = hostile.kwargs
    problem, inputs = check_decode_inputs(**kw, return_lse=lse_wanted)
    out, lse = _outputs(hostile, device)
    lse_arg = lse if lse_wanted else None
    backend.run_step(problem, inputs, out, lse_arg)
    return out, lse_arg


@FUZZ
@given(params=step_params(), seed=SEEDS)
def test_fuzz_reference_and_oracle(params: dict[str, Any], seed: int) -> None:
    hostile = make_hostile(params, seed)
    note(str(hostile))
    out, lse = _outputs(hostile)
    msa.sparse_decode(**hostile.kwargs, backend="reference", out=out, lse=lse)
    assert_close_to_naive(hostile, out, lse, where=f"reference [{hostile}]")
    if not params["ragged"]:  # the dense oracle takes uniform steps only
        kw = hostile.kwargs
        dense_out, dense_lse = dense_masked_attention(
            kw["q"], kw["kv_cache"], kw["topk_indices"], kw["block_table"], kw["seq_lens"],
            layout=msa.get_layout(kw["kv_cache_dtype"]), decode_query_len=kw["decode_query_len"],
            q_scale=kw["q_scale"], k_scale=kw["k_scale"], v_scale=kw["v_scale"],
        )
        assert_close_to_naive(hostile, dense_out, dense_lse, where=f"oracle [{hostile}]")


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
@FUZZ
@given(params=step_params(max_batch=2), seed=SEEDS, splits=st.sampled_from([None, 1, 3]),
       dedup=st.sampled_from([None, True, False]), lse_wanted=st.booleans(),
       tiles=st.sampled_from([{}, {"block_n": 16}, {"swap_ab": True}, {"swap_ab": True, "block_n": 16}]))
def test_fuzz_triton(params: dict[str, Any], seed: int, splits: int | None, dedup: bool | None, lse_wanted: bool,
                     tiles: dict[str, Any]) -> None:
    """Every kernel path, with tiles that start inside a page (`block_n` 16) and NVFP4's swap-AB
    walk among them."""
    device = "cpu" if INTERPRET else "cuda"
    hostile = make_hostile(params, seed, device=device)
    overrides: dict[str, Any] = dict(tiles)
    if splits is not None:
        overrides["num_splits"] = splits
    if dedup is not None:
        overrides["dedup"] = dedup
    note(f"{hostile} splits={splits} dedup={dedup} lse={lse_wanted} tiles={tiles}")
    out, lse = run_triton(hostile, TritonBackend(**overrides), lse_wanted, device)
    if lse is None:  # the no-LSE path: compare the output alone
        _, lse = _outputs(hostile)
        ref_out, ref_lse = msa.sparse_decode(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in hostile.kwargs.items()},
                                             backend="reference", return_lse=True)
        lse.copy_(ref_lse)
    # the interpreter truncates fp32 -> bf16 (a GPU rounds to nearest even): one bf16 ulp there;
    # on a GPU the dots round the softmax weights to bf16/fp16 (cases.gpu_atol)
    rtol = 2.0**-7 if INTERPRET and out.dtype == torch.bfloat16 else None
    assert_close_to_naive(hostile, out.cpu(), lse.cpu(), where=f"triton [{hostile} splits={splits} dedup={dedup}]",
                          atol=0.0 if INTERPRET else gpu_atol(hostile.kwargs), rtol=rtol)


@pytest.mark.skipif(not INTERPRET, reason="the CPU form of the gate's repeated calls (tests/gpu_check.py runs them on a GPU)")
@FUZZ
@given(params=step_params(max_batch=2), seed=SEEDS)
def test_fuzz_repeated_calls_on_the_direct_path(params: dict[str, Any], seed: int) -> None:
    """Each hostile step (ragged row counts among them) through `msa.sparse_decode` on the Triton
    backend twice: the second call takes the remembered signature and the direct launcher's
    binding (forced on: the interpreter never takes it by itself). Both equal the float64 loop."""
    import msa.backends.triton as triton_backend

    hostile = make_hostile(params, seed)
    note(str(hostile))
    original = triton_backend.direct_launch_enabled
    triton_backend.direct_launch_enabled = lambda: True  # type: ignore[assignment]
    try:
        for call in range(2):
            out, lse = _outputs(hostile)
            msa.sparse_decode(**hostile.kwargs, backend="triton", out=out, lse=lse)
            rtol = 2.0**-7 if out.dtype == torch.bfloat16 else None
            assert_close_to_naive(hostile, out, lse, where=f"triton call {call + 1} [{hostile}]", rtol=rtol)
    finally:
        triton_backend.direct_launch_enabled = original
