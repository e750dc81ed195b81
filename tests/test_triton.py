"""The Triton backend against the reference (CPU: the Triton interpreter; GPU: the real thing)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from cases import Case, build, gpu_atol

import msa
from msa.backends.triton import TritonBackend
from msa.backends.triton.config import choose_config
from msa.backends.triton.kernels import _nvfp4_scale_bytes, _q_low
from msa.errors import MSAInputError
from msa.layouts.nvfp4 import scale_byte_index
from msa.validation import check_decode_inputs

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)

LAYOUTS = ("bfloat16", "float16", "fp8_e4m3", "nvfp4")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_triton(kw: dict[str, Any], backend: TritonBackend, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Run with poisoned out/lse buffers on `device`; returns them on the CPU."""
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    problem, inputs = check_decode_inputs(**kw, return_lse=True)
    out_dtype = torch.bfloat16 if kw["q"].dtype == torch.float8_e4m3fn else kw["q"].dtype
    out = torch.full(kw["q"].shape, float("nan"), dtype=out_dtype, device=device)
    lse = torch.full(kw["q"].shape[:2], float("nan"), device=device)
    backend.run_step(problem, inputs, out, lse)
    return out.cpu(), lse.cpu()


def assert_matches_reference(
    kw: dict[str, Any], out: torch.Tensor, lse: torch.Tensor, rtol: float, atol: float = 2e-4
) -> None:
    """Interpreter: fp32 dots, so only the output's rounding differs. GPU: bf16/fp16 dots (the
    softmax weights are rounded to 8 or 11 bits), hence `atol` from `cases.gpu_atol` there."""
    ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten (poisoned) elements"
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=rtol, atol=atol)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out[empty] == 0).all()
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=2e-5)


def _matrix() -> list[tuple[Case, int]]:
    cases = []
    for n, (layout, length, group) in enumerate(itertools.product(LAYOUTS, (1, 3, 8), (1, 4, 16))):
        hkv = 2 if group < 16 else 1
        cases.append((
            Case(
                layout=layout, batch=3, query_len=length, num_q_heads=group * hkv, num_kv_heads=hkv,
                head_dim=(64, 128)[n % 2], page_size=(16, 32)[n % 3 == 0], topk=3, max_blocks=5,
                q_dtype=torch.float16 if layout == "float16" else torch.bfloat16,
                tensor_scales=n % 2 == 0, token_major=n % 3 == 1,
            ),
            (1, 2, 5)[n % 3],
        ))
    return cases


@pytest.mark.parametrize("case, splits", _matrix(), ids=lambda x: str(x))
def test_triton_matches_reference(case: Case, splits: int, gen: torch.Generator) -> None:
    built = build(case, gen)
    out, lse = run_triton(built.kwargs, TritonBackend(num_splits=splits))
    assert_matches_reference(built.kwargs, out, lse, rtol=2**-7)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_fp8_queries_and_big_groups(layout: str, gen: torch.Generator) -> None:
    """fp8 q with q_scale; a GQA group of 32 (two query heads per row of the tensor core tile)."""
    built = build(Case(layout=layout, q_dtype=torch.float8_e4m3fn, num_q_heads=32, num_kv_heads=1, topk=2, max_blocks=4), gen)
    out, lse = run_triton(built.kwargs, TritonBackend(num_splits=2))
    assert_matches_reference(built.kwargs, out, lse, rtol=2**-7)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bfloat16", "float16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("dedup", [False, True])
def test_triton_fp8_queries_on_gpu(layout: str, dedup: bool, gen: torch.Generator) -> None:
    """fp8 queries on the GPU's 16-bit dots, per token and deduplicated: the query converted
    through `kernels._opaque` (an identity the compiler keeps, for the dots' operand layout)."""
    built = build(Case(layout=layout, batch=3, query_len=3, q_dtype=torch.float8_e4m3fn, num_q_heads=16,
                       num_kv_heads=2, topk=3, max_blocks=5), gen)
    out, lse = run_triton(built.kwargs, TritonBackend(num_splits=2, dedup=dedup), DEVICE)
    assert_matches_reference(built.kwargs, out, lse, rtol=2**-7, atol=gpu_atol(built.kwargs))


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("splits, block_n", [(1, 32), (3, 16)])
def test_triton_nvfp4_kernel_forms(swap_ab: bool, splits: int, block_n: int, gen: torch.Generator) -> None:
    """Both NVFP4 walks (query heads or tokens as the dots' rows), fused and split, with partial
    last pages, -1 entries and a group smaller than the tile (masked query heads)."""
    built = build(Case(layout="nvfp4", batch=3, query_len=2, num_q_heads=12, num_kv_heads=2, page_size=32, topk=4,
                       max_blocks=6, tensor_scales=True), gen)
    kw = built.kwargs
    ids = kw["topk_indices"].clone()
    ids[0, 1, :2] = -1
    kw["topk_indices"] = ids
    kw["seq_lens"] = torch.tensor([37, 1, 150], dtype=torch.int32)
    out, lse = run_triton(kw, TritonBackend(num_splits=splits, block_n=block_n, swap_ab=swap_ab))
    assert_matches_reference(kw, out, lse, rtol=2**-7)


@triton.jit
def _scale_bytes_probe(slot_ptr, out_ptr, n, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    tok = tl.arange(0, PAGE)
    scale_bytes = _nvfp4_scale_bytes(slot_ptr, tok, tok < n, PAGE, HEAD_DIM, INTERLEAVED)
    g = tl.arange(0, HEAD_DIM // 16)
    tl.store(out_ptr + tok[:, None] * (HEAD_DIM // 16) + g[None, :], scale_bytes)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("visible", [0, 1, 37, 64])
def test_nvfp4_scales_of_unread_tokens_are_zero(interleaved: bool, visible: int, gen: torch.Generator) -> None:
    """The kernels' scale loads give a zero scale for every token past the row's length, whatever
    its byte holds (E4M3 NaN here). A direct check: the interpreter decodes 0x7F as 480, not NaN,
    so a leak would not show in the outputs of a CPU run (on the GPU it would be NaN)."""
    page, head_dim = 64, 128
    groups = head_dim // 16
    slot = torch.randint(0, 0x7F, (page * (head_dim // 2 + groups),), dtype=torch.uint8, generator=gen)
    token = torch.arange(page)[:, None]
    index = page * head_dim // 2 + scale_byte_index(token, torch.arange(groups)[None, :], groups, interleaved)
    slot[index[visible:]] = 0x7F
    out = torch.full((page, groups), 0xAA, dtype=torch.uint8)
    _scale_bytes_probe[(1,)](slot, out, visible, PAGE=page, HEAD_DIM=head_dim, INTERLEAVED=interleaved)
    assert torch.equal(out[:visible], slot[index[:visible]])
    assert (out[visible:] == 0).all()


def test_triton_group_chunks(gen: torch.Generator) -> None:
    """A group of 128 query heads per KV head: two programs per (row, head)."""
    built = build(Case(num_q_heads=128, num_kv_heads=1, topk=2, max_blocks=3, batch=2), gen)
    out, lse = run_triton(built.kwargs, TritonBackend())
    assert_matches_reference(built.kwargs, out, lse, rtol=2**-7)


def test_triton_edge_rows_and_strided_out(gen: torch.Generator) -> None:
    built = build(Case(batch=4, query_len=3, topk=4, max_blocks=6), gen)
    kw = built.kwargs
    kw["seq_lens"] = torch.tensor([0, 2, 37, 96], dtype=torch.int32)  # empty, shorter than L, partial page
    ids = kw["topk_indices"].clone()
    ids[:, 9:12] = -1  # request 3: nothing selected
    ids[0, 6, :] = torch.tensor([-1, 2, -1, 0], dtype=torch.int32)  # -1 at front and middle
    kw["topk_indices"] = ids
    problem, inputs = check_decode_inputs(**kw, return_lse=True)
    out_buf = torch.full((12, 8, 80), float("nan"), dtype=torch.bfloat16)
    lse_buf = torch.full((12, 10), float("nan"))
    backend = TritonBackend(num_splits=3)
    out, lse = out_buf[:, :, 8:72], lse_buf[:, 1:9]
    backend.run_step(problem, inputs, out, lse)
    assert_matches_reference(kw, out, lse, rtol=2**-7)
    assert torch.isnan(out_buf[:, :, :8]).all() and torch.isnan(lse_buf[:, 9:]).all()
    empty = [0, 1, 2, 3, 9, 10, 11]  # request 0; request 1's first row (position -1); request 3
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


def test_triton_through_the_api(gen: torch.Generator) -> None:
    built = build(Case(layout="nvfp4", batch=2, query_len=2), gen)
    out, lse = msa.sparse_decode(**built.kwargs, backend="triton", return_lse=True)
    assert_matches_reference(built.kwargs, out, lse, rtol=2**-7)


def test_triton_is_not_chosen_automatically_on_the_cpu() -> None:
    from msa.platform import Platform
    from msa.policy import SelectionPolicy

    built = build(Case(), torch.Generator().manual_seed(0))
    problem, _ = check_decode_inputs(**built.kwargs)
    cpu = Platform("cpu", packages=frozenset({"triton"}), triton_interpret=True)
    selection = SelectionPolicy().evaluate(problem, cpu)
    assert selection.chosen == "reference"
    assert "request it by name" in selection.rejected["triton"][0]
    assert SelectionPolicy().evaluate(problem, cpu, "triton").chosen == "triton"
    plain = Platform("cpu", packages=frozenset({"triton"}))
    assert "TRITON_INTERPRET=1" in SelectionPolicy().evaluate(problem, plain).rejected["triton"][0]


def test_config_depends_on_shapes_and_sms_only() -> None:
    m3 = msa.MINIMAX_M3
    small = choose_config(m3, 1, 132)
    assert small.num_splits > 1 and small.tiles_per_split * small.num_splits >= m3.topk * (m3.page_size // small.block_n)
    assert (small.block_n, small.num_splits) == (128, m3.topk), "B=1: one whole page per split"
    assert choose_config(m3, 256, 132).fused
    assert choose_config(m3, 1, 132) == choose_config(m3, 1, 132)
    wide = choose_config(msa.Geometry(128, 1, 128, 128, 16), 4, 132)
    assert wide.group_chunks == 2 and wide.block_g == 64


# ---- GPU: full MiniMax-M3 shapes -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("length", [1, 4])
def test_triton_full_m3_shapes_on_gpu(tp: int, layout: str, length: int) -> None:
    from msa.workload import make_decode_step

    step = make_decode_step(msa.MINIMAX_M3_TP[tp], batch_size=24, decode_query_len=length,
                            context_len=128 * 40, kv_cache_dtype=layout, device="cuda")
    kw = step.kwargs()
    backends = [TritonBackend(), TritonBackend(num_splits=1)]
    if layout == "nvfp4":  # both walks, whatever the default
        backends += [TritonBackend(swap_ab=True), TritonBackend(swap_ab=True, num_splits=1),
                     TritonBackend(swap_ab=False, num_splits=1)]
    for backend in backends:
        out, lse = run_triton(kw, backend, device="cuda")
        ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref_out.float().cpu(), rtol=2**-6, atol=gpu_atol(kw))
        torch.testing.assert_close(lse, ref_lse.cpu(), rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("case, splits", _matrix()[::4], ids=lambda x: str(x))
def test_triton_edge_cases_on_gpu(case: Case, splits: int, gen: torch.Generator) -> None:
    built = build(case, gen)
    out, lse = run_triton(built.kwargs, TritonBackend(num_splits=splits), device="cuda")
    assert_matches_reference(built.kwargs, out, lse, rtol=2**-6, atol=gpu_atol(built.kwargs))


@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("splits, dedup", [(1, False), (3, False), (1, True), (3, True)])
def test_triton_without_lse(layout: str, splits: int, dedup: bool, gen: torch.Generator) -> None:
    """WRITE_LSE=False (the serving default) on every kernel path: the output alone, checked."""
    built = build(Case(layout=layout, batch=3, query_len=3, topk=3, max_blocks=5), gen)
    kw = built.kwargs
    problem, inputs = check_decode_inputs(**kw)
    out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16)
    TritonBackend(num_splits=splits, dedup=dedup).run_step(problem, inputs, out)
    ref_out = msa.sparse_decode(**kw, backend="reference")
    assert not torch.isnan(out).any(), "unwritten (poisoned) elements"
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-7, atol=2e-4)


# ---- the in-kernel split merge (`in_kernel_merge`) ---------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_lse", [False, True])
def test_in_kernel_merge_matches_and_leaves_the_counters_at_zero(layout: str, with_lse: bool,
                                                                 gen: torch.Generator) -> None:
    """The last split of each program merges and zeroes its counter: the same plan runs again
    (as a captured graph replays) on fresh data and still matches, with -1 entries, a row that
    sees nothing and a partial last page."""
    from msa.planning import StepTables

    backend = TritonBackend(num_splits=4, in_kernel_merge=True)
    plan = None
    for _ in range(2):
        built = build(Case(layout=layout, batch=3, query_len=2, topk=4, max_blocks=5, tensor_scales=True), gen)
        kw = built.kwargs
        ids = kw["topk_indices"].clone()
        ids[0, 1, :2] = -1
        kw["topk_indices"] = ids
        kw["seq_lens"] = torch.tensor([37, 0, 150], dtype=torch.int32)[: kw["seq_lens"].shape[0]]
        problem, inputs = check_decode_inputs(**kw, return_lse=with_lse)
        if plan is None:
            plan = backend.plan(problem, StepTables.for_inputs(problem, inputs))
            assert plan.config.num_splits == 4 and plan.config.in_kernel_merge
        out = torch.full(kw["q"].shape, float("nan"), dtype=problem.out_dtype)
        lse = torch.full(kw["q"].shape[:2], float("nan")) if with_lse else None
        backend.run(plan, inputs, out, lse)
        assert (plan.workspace.counters == 0).all()
        if lse is not None:
            assert_matches_reference(kw, out, lse, rtol=2**-7)
        else:
            torch.testing.assert_close(out.float(), msa.sparse_decode(**kw, backend="reference").float(),
                                       rtol=2**-7, atol=2e-4)


def test_in_kernel_merge_is_per_token_only_and_for_few_splits() -> None:
    """Dedup steps keep the merge kernel (their rows are not one program group's); by default a
    per-token step merges in the kernel from 2 to IN_KERNEL_MERGE_MAX_SPLITS splits."""
    from msa.backends.triton.config import IN_KERNEL_MERGE_MAX_SPLITS

    g = msa.MINIMAX_M3
    assert not choose_config(g, 8, 132, query_len=4, batch_size=2, dedup=True, num_splits=4,
                             in_kernel_merge=True).in_kernel_merge
    assert choose_config(g, 2, 132, num_splits=16, in_kernel_merge=True).in_kernel_merge
    for rows in (1, 2, 8, 16, 24, 32, 64, 256):
        config = choose_config(g, rows, 132, layout=msa.get_layout("fp8_e4m3"))
        assert config.in_kernel_merge == (1 < config.num_splits <= IN_KERNEL_MERGE_MAX_SPLITS)
        assert not choose_config(g, rows, 132, in_kernel_merge=False).in_kernel_merge


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3", "nvfp4"])
def test_in_kernel_merge_replays_in_a_cuda_graph(layout: str) -> None:
    """200 replays of a captured B=1 M3 step (16 splits, every split's partials merged by the last
    to finish on another SM), each on fresh indices, against the two-kernel merge of the same
    step: equal to the last bit but for summation order (fp32), every replay."""
    from msa.planning import StepTables
    from msa.workload import make_decode_step

    step = make_decode_step(msa.MINIMAX_M3, batch_size=1, context_len=128 * 64, kv_cache_dtype=layout,
                            device="cuda", seed=3)
    kw = step.kwargs()
    problem, inputs = check_decode_inputs(**kw, return_lse=True)
    tables = StepTables.for_inputs(problem, inputs)
    fused, plain = TritonBackend(in_kernel_merge=True), TritonBackend()
    plan_f, plan_p = fused.plan(problem, tables), plain.plan(problem, tables)
    assert plan_f.config.num_splits > 1 and plan_f.config.in_kernel_merge
    out_f, lse_f = torch.empty_like(kw["q"]), torch.empty(kw["q"].shape[:2], device="cuda")
    out_p, lse_p = torch.empty_like(out_f), torch.empty_like(lse_f)
    topk = inputs.topk_indices
    for _ in range(2):  # compile and warm up outside the capture
        fused.run(plan_f, inputs, out_f, lse_f)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused.run(plan_f, inputs, out_f, lse_f)
    gen = torch.Generator(device="cuda").manual_seed(7)
    pages = kw["seq_lens"].max().item() // 128
    for _ in range(200):
        topk.copy_(torch.randperm(pages, device="cuda", generator=gen)[: topk.shape[-1]].int().expand_as(topk))
        out_f.fill_(float("nan"))
        graph.replay()
        plain.run(plan_p, inputs, out_p, lse_p)
        torch.testing.assert_close(out_f, out_p, rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(lse_f, lse_p, rtol=1e-5, atol=1e-5)
    assert (plan_f.workspace.counters == 0).all()


def test_dedup_programs_take_the_measured_tiles_and_stages() -> None:
    """The dedup program: 3 pipeline stages for every layout, 64-token tiles for bf16/fp16
    caches (whose 64-row programs ran 1.5x faster so on the H200), whole pages otherwise."""
    g = msa.MINIMAX_M3
    for layout, block_n in (("bfloat16", 64), ("float16", 64), ("fp8_e4m3", 128), ("nvfp4", 128)):
        config = choose_config(g, 128 * 4, 132, layout=msa.get_layout(layout), batch_size=128, query_len=4)
        assert config.dedup and (config.block_n, config.num_stages) == (block_n, 3), layout
        per_token = choose_config(g, 128, 132, layout=msa.get_layout(layout), batch_size=128, query_len=1)
        assert not per_token.dedup and per_token.block_n == 128


@pytest.mark.parametrize(("options", "match"), [
    (dict(num_split=4), r"^num_split: expected one of the Triton backend's options: dedup, num_splits, .*got an unknown option"),
    (dict(num_splits=0), r"^num_splits: expected an int >= 1 or None, got 0"),
    (dict(num_splits=True), r"^num_splits: expected an int >= 1 or None, got True"),
    (dict(block_n=7), r"^block_n: expected a power of two >= 16 \(tokens a tile\) or None, got 7"),
    (dict(block_n=8), r"^block_n: expected a power of two >= 16"),
    (dict(num_warps=3), r"^num_warps: expected a power of two from 1 to 32 or None, got 3"),
    (dict(num_warps=64), r"^num_warps: expected a power of two from 1 to 32 or None, got 64"),
    (dict(num_stages=0), r"^num_stages: expected an int >= 1 or None, got 0"),
    (dict(compute="nope"), r"^compute: expected 'fp16' or 'bf16' or None, got 'nope'"),
    (dict(dedup="yes"), r"^dedup: expected a bool or None, got 'yes'"),
    (dict(swap_ab=None), r"^swap_ab: expected a bool, got None"),
    (dict(merge_fence=1), r"^merge_fence: expected a bool, got 1"),
])
def test_backend_options_outside_what_the_kernels_take_are_refused(options: dict[str, Any], match: str) -> None:
    """A typo or a value no kernel takes is refused by name at construction (was: accepted, then a
    TypeError from choose_config or an interpreter error at the first step, or silently ignored)."""
    with pytest.raises(MSAInputError, match=match):
        TritonBackend(**options)
    TritonBackend(dedup=None, num_splits=None, block_n=256, num_warps=16, num_stages=3, compute="bf16", swap_ab=True)


def test_the_backend_options_are_choose_configs_overrides() -> None:
    """`config.OVERRIDES` (what TritonBackend checks) names exactly the keyword arguments of
    `choose_config` a step (or the GPU: its compute capability) does not fix itself."""
    import inspect

    from msa.backends.triton.config import OVERRIDES

    fixed = {"layout", "batch_size", "query_len", "dcp_size", "capability"}
    keywords = {name for name, p in inspect.signature(choose_config).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in fixed}
    assert set(OVERRIDES) == keywords


# ---- a bf16 query over a quantized cache (fp16 dots on the GPU) --------------------------------



def _gpu_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter, the GPU's fp16 dots for an fp8 or NVFP4 cache (the interpreter's own
    are fp32, where nothing overflows); the fit is then decided as on the GPU."""
    from msa.backends.triton import launch
    if DEVICE == "cpu":
        monkeypatch.setattr(launch, "_compute_dtype", lambda q_dtype, cache_dtype, config: (tl.float16, "ieee"))


def _fit_backend(form: str) -> TritonBackend:
    if form == "swap_ab":
        return TritonBackend(num_splits=2, swap_ab=True)
    return TritonBackend(num_splits=2, dedup=form == "dedup")


def _query_form_without(flag: str) -> Callable[[torch.dtype, object], dict[str, bool]]:
    """`launch._query_form` with `flag` (Q_FIT or Q_SPLIT) off: the control of a test that the flag matters."""
    from msa.backends.triton import launch
    own = launch._query_form
    return lambda q_dtype, compute: {**own(q_dtype, compute), flag: False}


def _fit_step(layout: str, form: str, gen: torch.Generator, num_q_heads: int = 8) -> dict[str, Any]:
    if form == "swap_ab" and layout != "nvfp4":
        pytest.skip("swap-AB is an NVFP4 walk")
    built = build(Case(layout=layout, batch=2, query_len=3, num_q_heads=num_q_heads, num_kv_heads=2, topk=3,
                       max_blocks=5), gen)
    return dict(built.kwargs)


FIT_LAYOUTS = ["fp8_e4m3", "nvfp4", "float16"]  # the caches a bf16 query meets in fp16 dots


@pytest.mark.parametrize("layout", FIT_LAYOUTS)
@pytest.mark.parametrize("form", ["per_token", "dedup", "swap_ab"])
@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e5, 1e30])
def test_bf16_query_fitted_into_fp16_range(layout: str, form: str, magnitude: float, gen: torch.Generator,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 query over an fp8, NVFP4 or fp16 cache meets the cache in fp16 dots: each head is scaled by
    a power of two into fp16's range first and its scores take it back. Without that a query past
    65504 was inf there (every output of its row NaN) and one below 2^-24 was 0 (checked: the
    control run without the fit fails at 1e5 and 1e-30). `sm_scale` takes the magnitude back, so
    that the scores stay well-conditioned for the fp32 reference (scores ~1e5 are not: 0.026 apart
    on an H100)."""
    _gpu_dots(monkeypatch)
    kw = _fit_step(layout, form, gen)
    kw["q"] = (kw["q"].float() * magnitude).bfloat16()
    kw["sm_scale"] = kw["q"].shape[-1] ** -0.5 / magnitude
    out, lse = run_triton(kw, _fit_backend(form), DEVICE)
    assert_matches_reference(kw, out, lse, rtol=2**-7, atol=gpu_atol(kw))
    if magnitude in (1e5, 1e-30):  # the control: the same step without the fit is wrong
        from msa.backends.triton import launch
        with monkeypatch.context() as patch:  # (undone at once: the GPU test calls this again)
            patch.setattr(launch, "_query_form", _query_form_without("Q_FIT"))
            bad, _ = run_triton(kw, _fit_backend(form), DEVICE)
        ref = msa.sparse_decode(**kw, backend="reference")
        assert bad.isnan().any() or (bad.float() - ref.float()).abs().max() > 10 * gpu_atol(kw)


@pytest.mark.parametrize("layout", FIT_LAYOUTS)
@pytest.mark.parametrize("form", ["per_token", "dedup", "swap_ab"])
def test_each_head_is_fitted_alone(layout: str, form: str, gen: torch.Generator,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads of one program (a GQA group; a dedup program's rows) at 1e30, 1, 1e-30 and with an Inf
    element: each finite head's answer is the reference's (one factor for the program flushed the
    small heads to 0 beside a large or Inf one: uniform attention, silently wrong); the Inf head
    changes no other."""
    _gpu_dots(monkeypatch)
    kw = _fit_step(layout, form, gen)
    q = kw["q"].float()
    for head, factor in ((0, 1e30), (2, 1e-30), (5, 1e20)):
        q[:, head::8] *= factor
    kw["q"] = q.bfloat16()
    out, _ = run_triton(kw, _fit_backend(form), DEVICE)
    ref = msa.sparse_decode(**kw, backend="reference").cpu()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=gpu_atol(kw))
    q = kw["q"].clone()
    q[:, 3, 0] = float("inf")  # one element of head 3 of every row
    kw["q"] = q
    poisoned, _ = run_triton(kw, _fit_backend(form), DEVICE)
    others = [h for h in range(8) if h != 3]
    torch.testing.assert_close(poisoned[:, others].float(), out[:, others].float(), rtol=0, atol=0)


def test_a_row_that_attends_nothing_moves_no_fit(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dedup program's row whose list is all -1 attends nothing (semantics: its query changes
    nothing): at 1e30 it must not move its siblings' fit."""
    _gpu_dots(monkeypatch)
    kw = _fit_step("fp8_e4m3", "dedup", gen)
    ids = kw["topk_indices"].clone()
    ids[:, 0] = -1  # row 0 (request 0's first token) selects nothing
    kw["topk_indices"] = ids
    q = kw["q"].float()
    q[0] *= 1e30
    kw["q"] = q.bfloat16()
    out, lse = run_triton(kw, _fit_backend("dedup"), DEVICE)
    assert_matches_reference(kw, out, lse, rtol=2**-7, atol=gpu_atol(kw))


def test_the_fitted_score_factor_stays_finite(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sm_scale` at the top of the range times a large head's factor passed float32's largest:
    a score of exactly 0 (zero keys) became 0 x Inf = NaN. The factor is held finite."""
    _gpu_dots(monkeypatch)
    kw = _fit_step("fp8_e4m3", "per_token", gen)
    kw["kv_cache"] = kw["kv_cache"].clone()
    kw["kv_cache"][..., : kw["q"].shape[-1]] = 0  # every key 0: every score 0
    kw["q"] = torch.full_like(kw["q"], 65536.0)
    kw["sm_scale"], kw["k_scale"], kw["v_scale"] = 1.6e38, 1.0, 1.0
    out, lse = run_triton(kw, _fit_backend("per_token"), DEVICE)
    assert_matches_reference(kw, out, lse, rtol=2**-7, atol=gpu_atol(kw))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", FIT_LAYOUTS)
@pytest.mark.parametrize("form", ["per_token", "dedup", "swap_ab"])
def test_bf16_query_past_fp16_range_on_gpu(layout: str, form: str, gen: torch.Generator,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp16 dots themselves (the GPU gate): the magnitudes and the heads fitted alone."""
    for magnitude in (1e5, 1e30, 1e-30):
        test_bf16_query_fitted_into_fp16_range(layout, form, magnitude, gen, monkeypatch)
    test_each_head_is_fitted_alone(layout, form, gen, monkeypatch)


# ---- an f16 query meeting bf16 dots (a bf16 cache) ----------------------------------------------


@triton.jit
def _q_low_probe(q_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    q = tl.load(q_ptr + i)
    tl.store(hi_ptr + i, q.to(tl.bfloat16).to(tl.float32))
    tl.store(lo_ptr + i, _q_low(q, True, tl.bfloat16).to(tl.float32))


def test_an_f16_query_is_two_exact_bf16_terms(gen: torch.Generator) -> None:
    """`kernels._q_low`: an f16 query element is bf16(q) + low exactly, low itself a bf16 (f16's 11
    significant bits in two bf16 terms; f16's largest, smallest normal and subnormals, signed
    zeros and random elements), and low is 0 where bf16(q) is Inf or NaN."""
    special = [65504.0, -65504.0, 6.1035e-05, 5.96e-08, -5.96e-08, 0.0, -0.0, 1.0 + 2**-10, 3.0 - 2**-9]
    finite = torch.cat([torch.tensor(special), torch.randn(242, generator=gen) * 100]).half()
    q = torch.cat([finite, torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=torch.half),
                   torch.zeros(2, dtype=torch.half)])  # (256: a power of two)
    hi, lo = torch.empty(len(q)), torch.empty(len(q))
    _q_low_probe[(1,)](q, hi, lo, N=len(q))
    n = len(finite)
    assert torch.equal(lo, lo.bfloat16().float())  # each term is a bf16
    assert torch.equal(hi[:n].double() + lo[:n].double(), finite.double())
    assert (lo[n:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "form"), [("bfloat16", "per_token"), ("bfloat16", "dedup"),
                                              ("fp8_e4m3", "per_token"), ("fp8_e4m3", "dedup"),
                                              ("nvfp4", "per_token"), ("nvfp4", "swap_ab"), ("nvfp4", "dedup")])
def test_f16_query_meeting_bf16_dots_on_gpu(layout: str, form: str, gen: torch.Generator,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An f16 query meeting bf16 dots (a bf16 cache; an fp8 or NVFP4 one with `compute="bf16"`)
    is two bf16 terms (`launch._query_form`; over a bf16 cache it ran fp32 IEEE dots before, ~30x
    slower): its scores are the f16 query's, as the reference's LSE shows at 1e-5. Control: the
    same step with the query rounded to bf16 (the split off) moves the LSE by > 4e-3 (scores of
    std ~8)."""
    from msa.backends.triton import launch

    built = build(Case(layout=layout, batch=2, query_len=3, num_q_heads=8, num_kv_heads=2, topk=3,
                       max_blocks=5, q_dtype=torch.float16), gen)
    kw = dict(built.kwargs, sm_scale=1.0)
    options = {} if layout == "bfloat16" else {"compute": "bf16"}

    def backend() -> TritonBackend:
        if form == "swap_ab":
            return TritonBackend(num_splits=2, swap_ab=True, **options)
        return TritonBackend(num_splits=2, dedup=form == "dedup", **options)

    out, lse = run_triton(kw, backend(), DEVICE)
    assert_matches_reference(kw, out, lse, rtol=2**-7, atol=gpu_atol(kw))
    with monkeypatch.context() as patch:
        patch.setattr(launch, "_query_form", _query_form_without("Q_SPLIT"))
        _, bad = run_triton(kw, backend(), DEVICE)
    ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)[1].cpu()
    seen = ~torch.isneginf(ref_lse)
    assert (bad[seen] - ref_lse[seen]).abs().max() > 4e-3
