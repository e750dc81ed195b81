"""Every validation error (docs/semantics.md §6): the argument, the expectation and what was given."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import msa
from msa.errors import MSAError, MSAInputError, MSAKeyError, MSAUnsupportedError
from msa.layouts import get_layout
from msa.validation import check_decode_inputs

B, L, HQ, HKV, D, P, K, MB, PAGES = 2, 2, 8, 2, 64, 16, 4, 4, 10


def good(**changes: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        q=torch.randn(B * L, HQ, D).bfloat16(),
        kv_cache=torch.randn(PAGES, HKV, P, 2 * D).bfloat16(),
        topk_indices=torch.tensor([0, 1, 2, -1], dtype=torch.int32).repeat(HKV, B * L, 1),
        block_table=torch.arange(B * MB, dtype=torch.int32).view(B, MB),
        seq_lens=torch.tensor([40, 64], dtype=torch.int32),
        decode_query_len=L,
    )
    kw.update(changes)
    return kw


def fails(match: str, **changes: Any) -> None:
    with pytest.raises(MSAInputError, match=match):
        msa.sparse_decode(**good(**changes))


def test_good_inputs_pass_with_deep_checks() -> None:
    out = msa.sparse_decode(**good(), validate=True)
    assert isinstance(out, torch.Tensor) and out.shape == (B * L, HQ, D)
    problem, _ = check_decode_inputs(**good())
    assert problem.geometry == msa.Geometry(HQ, HKV, D, P, K)
    assert (problem.batch_size, problem.query_len, problem.kv_layout) == (B, L, "bfloat16")


def test_errors_are_msa_and_value_errors() -> None:
    with pytest.raises(MSAError):
        msa.sparse_decode(**good(q=None))
    with pytest.raises(ValueError):
        msa.sparse_decode(**good(q=None))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(q=None), r"^q: expected a torch.Tensor, got NoneType"),
        (dict(q=torch.zeros(4, 8)), r"^q: expected a 3-D tensor \[B\*L, Hq, D\], got shape \(4, 8\)"),
        (dict(q=torch.zeros(4, 8, 64)), r"^q: expected dtype bfloat16, float16 or float8_e4m3fn, got torch.float32"),
        (dict(q=torch.zeros(4, 64, 8).bfloat16().transpose(1, 2)), r"^q: expected unit stride in the last dimension"),
        (dict(q=torch.zeros(4, 8, 32).bfloat16()), r"^q / kv_cache: expected the same head dim, got head dim 32 in q and 64 in kv_cache \(a last dimension of 128 in the bfloat16 layout\)"),
        (dict(kv_cache=torch.zeros(10, HKV, P, 2 * D - 6).bfloat16()), r"^q / kv_cache: expected the same head dim, got head dim 64 in q and 61 in kv_cache \(a last dimension of 122"),
        (dict(q=torch.zeros(4, 7, 64).bfloat16()), r"^q: expected a number of heads divisible by the cache's 2 KV heads, got 7 heads"),
        (dict(q=torch.zeros(6, 8, 64).bfloat16()), r"^q: expected B\*L = 2\*2 = 4 rows .* got 6 rows"),
        (dict(kv_cache=torch.zeros(PAGES, HKV, P, 2 * D)), r"^kv_cache: expected dtype bfloat16, float16, float8_e4m3fn or uint8"),
        (dict(kv_cache=torch.zeros(PAGES, HKV, 2 * D).bfloat16()), r"^kv_cache: expected a 4-D tensor \[pages, Hkv, P, 2\*D\], got shape"),
        (dict(kv_cache=torch.zeros(PAGES, HKV, P, 2 * D + 1).bfloat16()), r"^kv_cache: expected an even last dimension"),
        (dict(kv_cache=torch.zeros(PAGES, HKV, 2 * D, P).bfloat16().transpose(2, 3)), r"^kv_cache: expected unit stride in the last dimension"),
        (dict(kv_cache=torch.zeros(PAGES, 2 * HKV, P, 70, dtype=torch.uint8)), r"^kv_cache: expected nvfp4 shape \[pages, 2\*Hkv, P, D/2 \+ D/16\]"),
        (dict(kv_cache=torch.zeros(PAGES, HKV, P, 2 * D).bfloat16(), kv_cache_dtype="fp8"), r"^kv_cache: expected dtype torch.float8_e4m3fn for the 'fp8_e4m3' layout, got torch.bfloat16"),
        (dict(kv_cache_dtype="fp4"), r"^kv_cache_dtype: expected one of 'auto', .*got 'fp4'"),
        (dict(kv_cache=torch.zeros(PAGES, HKV, P, 2 * D, device="meta").bfloat16()), r"^kv_cache: expected a tensor on cpu \(the device of q\), got meta"),
        (dict(decode_query_len=0), r"^decode_query_len: expected an int >= 1, got 0"),
        (dict(decode_query_len=True), r"^decode_query_len: expected an int >= 1, got True"),
        (dict(decode_query_len=2.0), r"^decode_query_len: expected an int >= 1, got 2.0"),
        (dict(seq_lens=torch.tensor([40, 64])), r"^seq_lens: expected an int32 tensor \[B\], got torch.int64 of shape \(2,\)"),
        (dict(seq_lens=[40, 64]), r"^seq_lens: expected a torch.Tensor, got list"),
        (dict(block_table=torch.zeros(B, MB, dtype=torch.int64)), r"^block_table: expected an int32 tensor \[B, max_blocks\], got torch.int64"),
        (dict(block_table=torch.zeros(3, MB, dtype=torch.int32)), r"^block_table: expected shape \[2, max_blocks >= 1\] \(B from seq_lens\), got \(3, 4\)"),
        (dict(block_table=torch.zeros(MB, B, dtype=torch.int32).t()), r"^block_table: expected unit stride in the last dimension"),
        (dict(block_table=torch.zeros(B, MB, dtype=torch.int32, device="meta")), r"^block_table: expected a tensor on cpu \(the device of q\), got meta"),
        (dict(topk_indices=torch.zeros(HKV, B * L, K)), r"^topk_indices: expected an int32 tensor \[Hkv, B\*L, K\], got torch.float32"),
        (dict(topk_indices=torch.zeros(B * L, HKV, K, dtype=torch.int32)), r"^topk_indices: expected shape \[2, 4, K >= 1\] .*\.transpose\(0, 1\).*got \(4, 2, 4\)"),
        (dict(topk_indices=torch.zeros(HKV, B * L, 0, dtype=torch.int32)), r"^topk_indices: expected shape \[2, 4, K >= 1\]"),
        (dict(sm_scale="0.1"), r"^sm_scale: expected a float or a one-element fp32 tensor, got str"),
        (dict(q_scale=True), r"^q_scale: expected a float or a one-element fp32 tensor, got True"),
        (dict(k_scale=torch.ones(2)), r"^k_scale: expected a one-element float32 tensor, got a torch.float32 tensor of shape \(2,\)"),
        (dict(v_scale=torch.ones(1, dtype=torch.float64)), r"^v_scale: expected a one-element float32 tensor, got a torch.float64"),
        (dict(k_scale=torch.ones(1, device="meta")), r"^k_scale: expected a tensor on cpu \(the device of the data it scales\), got a tensor on meta"),
        (dict(out=torch.zeros(B * L, HQ, D)), r"^out: expected a torch.bfloat16 tensor of shape \(4, 8, 64\), got torch.float32 of shape"),
        (dict(out=torch.zeros(B * L, HQ, D + 1).bfloat16()), r"^out: expected a torch.bfloat16 tensor of shape \(4, 8, 64\)"),
        (dict(out=torch.zeros(B * L, D, HQ).bfloat16().transpose(1, 2)), r"^out: expected unit stride in the last dimension"),
        (dict(lse=torch.zeros(B * L, HQ).bfloat16()), r"^lse: expected a torch.float32 tensor of shape \(4, 8\), got torch.bfloat16"),
        # hostile values the cheap checks catch (issue: trust under hostile input)
        (dict(sm_scale=float("nan")), r"^sm_scale: expected a finite scale > 0 within float32.s normal range \[2\^-125, 1.7e38\], got nan"),
        (dict(k_scale=float("inf")), r"^k_scale: expected a finite scale > 0 within float32.s normal range \[2\^-125, 1.7e38\], got inf"),
        (dict(v_scale=-0.5), r"^v_scale: expected a finite scale > 0 within float32.s normal range \[2\^-125, 1.7e38\], got -0.5"),
        (dict(q_scale=0), r"^q_scale: expected a finite scale > 0 within float32.s normal range \[2\^-125, 1.7e38\], got 0"),
        (dict(return_lse="yes"), r"^return_lse: expected True or False, got 'yes'"),
        (dict(validate=1), r"^validate: expected True or False, got 1"),
        (dict(backend=None), r"^backend: expected 'auto' or a backend name \(a str\), got None"),
        (dict(out=torch.zeros(HQ, D).bfloat16().expand(B * L, HQ, D)), r"^out: expected a tensor whose elements do not overlap in memory"),
        (dict(out=torch.zeros(B * L * D + HQ).bfloat16().as_strided((B * L, HQ, D), (D, 1, 1))), r"^out: expected a tensor whose elements do not overlap"),
        (dict(lse=torch.zeros(HQ).expand(B * L, HQ)), r"^lse: expected a tensor whose elements do not overlap in memory"),
        (dict(kv_cache=torch.zeros(0, HKV, P, 2 * D).bfloat16()), r"^kv_cache: expected at least one page and one KV head, got shape \(0, 2, 16, 128\)"),
        # degenerate shapes are refused by name before any arithmetic on them (was ZeroDivisionError)
        (dict(kv_cache=torch.zeros(PAGES, 0, P, 2 * D).bfloat16()), r"^kv_cache: expected at least one page and one KV head, got shape \(10, 0, 16, 128\)"),
        (dict(kv_cache=(torch.zeros(PAGES, 0, P, D).bfloat16(), torch.zeros(PAGES, 0, P, D).bfloat16())), r"^kv_cache: expected at least one page and one KV head, got shape \(10, 0, 16, 64\)"),
        (dict(q=torch.zeros(B * L, HQ, 0).bfloat16(), kv_cache=torch.zeros(PAGES, HKV, P, 0).bfloat16()), r"^q: expected at least one head and a head dim >= 1 \(\[B\*L, Hq >= 1, D >= 1\]\), got shape \(4, 8, 0\)"),
        (dict(q=torch.zeros(B * L, 0, D).bfloat16()), r"^q: expected at least one head and a head dim >= 1"),
        (dict(sm_scale=10**400), r"^sm_scale: expected a finite scale > 0 within float32.s normal range \[2\^-125, 1.7e38\], got an int of 1329 bits"),
        (dict(k_scale=-(10**400)), r"^k_scale: expected a finite scale > 0 within float32.s normal range \[2\^-125, 1.7e38\], got an int of 1329 bits"),
        # finite doubles that float32, where every backend computes, cannot hold (1e39 gave NaN outputs)
        (dict(sm_scale=1e39), r"^sm_scale: expected a finite scale > 0 within float32.s normal range .*, got 1e\+39"),
        (dict(v_scale=1e-40), r"^v_scale: expected a finite scale > 0 within float32.s normal range .*, got 1e-40"),
        (dict(sm_scale=1e30, k_scale=1e20), r"^sm_scale \* q_scale \* k_scale: expected a product within float32.s normal range .* got 1e\+50"),
        (dict(sm_scale=1e-30, q_scale=1e-30), r"^sm_scale \* q_scale \* k_scale: expected a product within float32.s normal range"),
    ],
)
def test_cheap_checks(changes: dict[str, Any], match: str) -> None:
    fails(match, **changes)


def test_out_must_not_overlap_q_or_lse() -> None:
    kw = good()
    with pytest.raises(MSAInputError, match=r"^out: expected memory that does not overlap q"):
        msa.sparse_decode(**kw, out=kw["q"])
    buf = torch.zeros(B * L * HQ * D).bfloat16()
    lse_view = buf.view(torch.float32)[: B * L * HQ].view(B * L, HQ)
    with pytest.raises(MSAInputError, match=r"^lse: expected memory that does not overlap out"):
        msa.sparse_decode(**kw, out=buf.view(B * L, HQ, D), lse=lse_view)


def test_lse_must_not_overlap_q() -> None:
    """An lse inside q's memory was accepted (the kernels then overwrite the queries they read)."""
    kw = good()
    lse = kw["q"].view(torch.float32).flatten()[: B * L * HQ].view(B * L, HQ)  # fp32 inside q's bytes
    for call in range(2):  # the first call checks in full; the second takes the remembered signature
        with pytest.raises(MSAInputError, match=r"^lse: expected memory that does not overlap q"):
            msa.sparse_decode(**kw, lse=lse)
        if call == 0:  # a good call with this signature, so the next bad one takes the remembered path
            msa.sparse_decode(**kw, lse=torch.empty_like(lse))


def test_deep_checks_read_tensor_scales() -> None:
    for bad in (float("nan"), float("inf"), 0.0, -1.0, 1e-40):
        with pytest.raises(MSAInputError, match=r"^k_scale: expected a finite scale > 0 within float32.s normal range \[2\^-125, 1.7e38\], got a tensor holding"):
            msa.sparse_decode(**good(k_scale=torch.tensor([bad])), validate=True)
    with pytest.raises(MSAInputError, match=r"^sm_scale \* q_scale \* k_scale: expected a product within"):
        msa.sparse_decode(**good(k_scale=torch.tensor([1e30]), sm_scale=1e30), validate=True)
    msa.sparse_decode(**good(k_scale=torch.tensor([1e30]), sm_scale=1e-30))  # (a product in range)


def test_fp8_queries_need_bf16_out() -> None:
    q = torch.randn(B * L, HQ, D).to(torch.float8_e4m3fn)
    fails(r"^out: expected a torch.bfloat16 tensor", q=q, out=torch.zeros(B * L, HQ, D).to(torch.float8_e4m3fn))


def test_unknown_backend() -> None:
    with pytest.raises(MSAInputError, match=r"^backend: expected 'auto' or one of 'cutlass_sm100', 'flashinfer', 'cute', 'triton', 'reference', got 'cuda'"):
        msa.sparse_decode(**good(), backend="cuda")


def deep(match: str, **changes: Any) -> None:
    with pytest.raises(MSAInputError, match=match):
        msa.sparse_decode(**good(**changes), validate=True)
    msa.sparse_decode(**good(**changes))  # without validate=True the step still runs (entries skipped)


def _ids(row: int, head: int, values: list[int]) -> torch.Tensor:
    ids = good()["topk_indices"].clone()
    ids[head, row] = torch.tensor(values, dtype=torch.int32)
    return ids


def test_deep_checks_index_range() -> None:
    deep(
        r"^topk_indices: expected -1 or a block id in \[0, 4\) .*got 4 at head 1, row 3 \(request 1, token 1\), entry 2",
        topk_indices=_ids(3, 1, [0, 1, 4, -1]),
    )
    deep(r"^topk_indices: expected -1 or .*got -2 at head 0, row 1", topk_indices=_ids(1, 0, [-2, 1, 2, 3]))


def test_deep_checks_first_row_is_reported() -> None:
    ids = _ids(3, 0, [9, -1, -1, -1])
    ids[1, 2, 0] = 7
    deep(r"got 7 at head 1, row 2 \(request 1, token 0\), entry 0", topk_indices=ids)


def test_deep_checks_duplicates() -> None:
    deep(
        r"^topk_indices: expected distinct block ids within one list, got 2 repeated at head 0, row 2 \(request 1, token 0\), entry 3",
        topk_indices=_ids(2, 0, [2, 1, -1, 2]),
    )
    msa.sparse_decode(**good(topk_indices=_ids(2, 0, [-1, 1, -1, -1])), validate=True)  # -1 may repeat


def test_deep_checks_pages() -> None:
    table = good()["block_table"].clone()
    table[1, 1] = -1
    deep(
        r"^block_table: expected a page in \[0, 10\) for every selected visible block, got block_table\[1, 1\] = -1, selected at head 0, row 2",
        block_table=table,
    )
    table[1, 1] = 10
    deep(r"got block_table\[1, 1\] = 10", block_table=table)
    table = good()["block_table"].clone()
    table[0, 3] = -1  # request 0 sees 39..40 tokens: block 3 not visible, its page may be anything
    msa.sparse_decode(**good(block_table=table, topk_indices=_ids(0, 0, [3, 0, -1, -1])), validate=True)


def test_deep_checks_seq_lens() -> None:
    deep(r"^seq_lens: expected lengths >= 0, got seq_lens\[0\] = -1", seq_lens=torch.tensor([-1, 3], dtype=torch.int32))
    deep(
        r"^seq_lens: expected at most max_blocks \* page_size = 64 tokens .*got seq_lens\[1\] = 65",
        seq_lens=torch.tensor([3, 65], dtype=torch.int32),
    )


def test_deep_checks_take_a_ragged_step_of_no_request() -> None:
    """B = 0 with padding rows: every row attends nothing, with or without the deep checks (they
    indexed the empty block table: IndexError)."""
    kw = good(q=torch.randn(2, HQ, D).bfloat16(), topk_indices=torch.full((HKV, 2, K), -1, dtype=torch.int32),
              block_table=torch.zeros(0, MB, dtype=torch.int32), seq_lens=torch.zeros(0, dtype=torch.int32),
              query_start_loc=torch.zeros(1, dtype=torch.int32), decode_query_len=1, return_lse=True)
    for validate in (False, True):
        out, lse = msa.sparse_decode(**kw, validate=validate)
        assert not out.any() and bool((lse == float("-inf")).all())


def test_deep_checks_take_a_query_len_past_int64() -> None:
    """A ragged step's L is a cap on each request's rows: one past int64's range is refused by
    the backends' limits with or without the deep checks (they overflowed: OverflowError)."""
    kw = good(q=torch.randn(2, HQ, D).bfloat16(), topk_indices=torch.full((HKV, 2, K), -1, dtype=torch.int32),
              query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), decode_query_len=2**64)
    for validate in (False, True):
        with pytest.raises(MSAUnsupportedError, match=r"needs 1 <= L <= 2147483647"):
            msa.sparse_decode(**kw, validate=validate)


def test_msa_validate_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = good(topk_indices=_ids(2, 0, [2, 1, -1, 2]))
    msa.sparse_decode(**bad)
    monkeypatch.setenv("MSA_VALIDATE", "1")
    with pytest.raises(MSAInputError, match="distinct block ids"):
        msa.sparse_decode(**bad)


def test_unsupported_error_lists_reasons() -> None:
    err = MSAUnsupportedError("no backend", {"a": ["needs CUDA", "P must be 128"], "b": ["L > 8"]})
    assert str(err) == "no backend\n  a: needs CUDA; P must be 128\n  b: L > 8"
    assert err.reasons["b"] == ["L > 8"] and isinstance(err, MSAError)


def test_geometry_validation() -> None:
    with pytest.raises(MSAInputError, match=r"^num_q_heads: expected a multiple of num_kv_heads=4, got 6"):
        msa.Geometry(6, 4, 128, 128, 16)
    with pytest.raises(MSAInputError, match=r"^head_dim: expected a positive int, got 0"):
        msa.Geometry(8, 1, 0, 128, 16)
    with pytest.raises(MSAInputError, match=r"^tp_size: expected a positive divisor of num_q_heads=64, got 3"):
        msa.MINIMAX_M3.tensor_parallel(3)


def test_minimax_geometries() -> None:
    heads = {tp: (g.num_q_heads, g.num_kv_heads) for tp, g in msa.MINIMAX_M3_TP.items()}
    assert heads == {1: (64, 4), 2: (32, 2), 4: (16, 1), 8: (8, 1)}
    m3 = msa.MINIMAX_M3
    assert (m3.head_dim, m3.page_size, m3.topk, m3.group_size) == (128, 128, 16, 16)
    assert {m3: 1}[msa.Geometry(64, 4, 128, 128, 16)] == 1  # hashable value: usable as a key


def _offset(t: torch.Tensor, elements: int) -> torch.Tensor:
    """`t`'s values in a tensor whose storage starts `elements` elements later (same strides)."""
    flat = torch.empty(t.numel() + elements, dtype=t.dtype)
    view = flat[elements:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3", "nvfp4"])
def test_the_problem_says_whether_vector_loads_may_read_the_step(layout: str) -> None:
    """`vector_aligned`: q/out rows on 4 bytes, the cache's bases, pages, heads (and tokens) on 16;
    a call signature of a misaligned view differs from the aligned one's, so the answer is never
    reused for the wrong alignment."""
    from msa.validation import call_signature, vector_misalignment
    from msa.workload import make_decode_step

    step = make_decode_step(msa.Geometry(HQ, HKV, 128, P, K), batch_size=2, context_len=60, kv_cache_dtype=layout,
                            seed=1)
    kw = step.kwargs()
    problem, inputs = check_decode_inputs(**kw)
    assert problem.vector_aligned
    q_odd = _offset(kw["q"], 1 if kw["q"].element_size() == 2 else 2)
    problem, _ = check_decode_inputs(**{**kw, "q": q_odd})
    assert not problem.vector_aligned
    cache = kw["kv_cache"]
    shifted = _offset(cache, 16 // cache.element_size() // 2 or 8)
    problem, inputs = check_decode_inputs(**{**kw, "kv_cache": shifted})
    assert not problem.vector_aligned
    reason = vector_misalignment(inputs.q, None, inputs.layout.kv_operands(shifted), inputs.layout.block_scaled)
    assert reason is not None and reason[0] == "kv_cache" and "16 bytes" in reason[1]
    assert call_signature((kw["q"],), ()) != call_signature((q_odd,), ())
    # the reference reads a misaligned step as any other
    out = msa.sparse_decode(**{**kw, "q": q_odd}, backend="reference")
    torch.testing.assert_close(out, msa.sparse_decode(**kw, backend="reference"))


def test_first_hour_edges() -> None:
    """decode_query_len defaults to one token; a CUDA cache without CUDA, an unknown TP size and a
    cache of the wrong width each get a named msa error."""
    kw = good()
    one = dict(kw, q=kw["q"][::L].contiguous(), topk_indices=kw["topk_indices"][:, ::L].contiguous())
    del one["decode_query_len"]
    out = msa.sparse_decode(**one)
    assert out.shape == (B, HQ, D)
    assert torch.equal(out, msa.sparse_decode(**one, decode_query_len=1))
    if not torch.cuda.is_available():
        with pytest.raises(MSAInputError, match=r"^device: expected a device this machine has"):
            get_layout("fp8").allocate(4, 2, 16, 64, device="cuda")
    with pytest.raises(KeyError) as info:
        msa.MINIMAX_M3_TP[3]
    assert isinstance(info.value, MSAInputError)
    assert str(info.value).startswith("MINIMAX_M3_TP: expected a tensor-parallel size in [1, 2, 4, 8], got 3")
    assert msa.MINIMAX_M3_TP.get(3) is None and msa.MINIMAX_M3_TP[8].num_q_heads == 8


@pytest.mark.parametrize("error", [
    MSAInputError("q", "a CUDA tensor", "a CPU tensor", "move it first"),
    MSAKeyError("backend", "a registered name", "'nope'"),
    MSAUnsupportedError("no backend serves this step", {"triton": ["needs a GPU"], "cute": ["sm_90a"]}),
])
def test_errors_survive_pickling_whole(error: MSAError) -> None:
    """An msa error raised in a worker process (multiprocessing pickles it) reaches the parent as
    the same type with the same message and attributes."""
    error.add_note("raised in a worker")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert vars(back) == vars(error) and back.__notes__ == ["raised in a worker"]
