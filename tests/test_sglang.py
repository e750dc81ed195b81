"""msa.integrations.sglang: SGLang's Hopper MiniMax-M3 decode entry on msa, over SGLang's own pools.

The fixture builds SGLang's structures as SGLang keeps them — per-layer token pools
`[slots, Hkv, D]`, pages of `page_size` consecutive slots handed out in any order (page 0
reserved), `req_to_token` mapping each request's positions to slots, `req_pool_indices` — and
the same data as msa's packed cache, so the drop-in is compared with msa's reference."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from cases import gpu_atol
from engine_oracles import assert_close_to_oracle, sglang_decode_oracle

import msa
from msa.integrations.sglang import flash_decode_with_gqa_share_sparse, pools_as_pages
from msa.workload import indexer_topk

INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
BLOCK = 16  # the sparse block (128 for M3; small here for the CPU)


def _sglang_state(gen: torch.Generator, layout: str, page_size: int = 32, batch: int = 3, device: str = "cpu",
                  lens: list[int] | None = None) -> dict[str, Any]:
    hkv, hq, d, k = 2, 8, 64, 4
    dtype = torch.float8_e4m3fn if layout == "fp8_e4m3" else torch.bfloat16
    max_reqs, max_context = batch + 3, 8 * BLOCK
    num_pages = batch * -(-max_context // page_size) + 2
    k_pool = (torch.randn((num_pages * page_size, hkv, d), generator=gen) * 2).to(dtype)
    v_pool = (torch.randn((num_pages * page_size, hkv, d), generator=gen) * 2).to(dtype)
    req_to_token = torch.zeros((max_reqs, max_context), dtype=torch.int32)
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 is SGLang's dummy page
    if lens is None:
        lens = [int(torch.randint(1, max_context, (1,), generator=gen)) for _ in range(batch)]
    slot_ids = torch.randperm(max_reqs, generator=gen)[:batch].int()
    for req, n in zip(slot_ids.tolist(), lens, strict=True):
        n = min(n, max_context)  # a longer seq_lens entry is clamped by the kernel
        pages = [free.pop() for _ in range(-(-n // page_size))]
        pos = torch.arange(n)
        req_to_token[req, :n] = (torch.tensor(pages)[pos // page_size] * page_size + pos % page_size).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    topk = indexer_topk(seq_lens, decode_query_len=1, num_kv_heads=hkv, topk=k, page_size=BLOCK,
                        max_blocks=max_context // BLOCK, generator=gen).contiguous()
    q = torch.randn((batch, hq, d), generator=gen).bfloat16()
    state = dict(q=q, k_pool=k_pool, v_pool=v_pool, req_to_token=req_to_token, seq_lens=seq_lens,
                 slot_ids=slot_ids, topk=topk, page_size=page_size, k_scale=0.5 if layout == "fp8_e4m3" else None)
    return {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in state.items()}


def _drop_in(s: dict[str, Any], **changes: Any) -> torch.Tensor:
    kw: dict[str, Any] = dict(q=s["q"], sink=None, k_cache=s["k_pool"], v_cache=s["v_pool"], req_to_token=s["req_to_token"],
                              seq_lens=s["seq_lens"], slot_ids=s["slot_ids"], block_size=BLOCK, topk_idx=s["topk"],
                              page_size=s["page_size"], k_scale=s["k_scale"], v_scale=s["k_scale"])
    kw.update(changes)
    return flash_decode_with_gqa_share_sparse(**kw)


def _reference(s: dict[str, Any]) -> torch.Tensor:
    """msa's reference on the same data in msa's own packed cache (blocks gathered by position)."""
    pools = (s["k_pool"], s["v_pool"])
    pages = pools[0].shape[0] // BLOCK
    packed = torch.cat([p[: pages * BLOCK].view(pages, BLOCK, *p.shape[1:]).transpose(1, 2) for p in pools], dim=-1)
    table = (s["req_to_token"][s["slot_ids"].long(), ::BLOCK] // BLOCK).int()
    scale = 1.0 if s["k_scale"] is None else s["k_scale"]
    out = msa.sparse_decode(s["q"], packed.contiguous(), s["topk"], table, s["seq_lens"], decode_query_len=1,
                            backend="reference", k_scale=scale, v_scale=scale)
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3"])
def test_drop_in_equals_the_reference(layout: str, gen: torch.Generator) -> None:
    s = _sglang_state(gen, layout)
    out = _drop_in(s)
    assert out.shape == s["q"].shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(s).float(), rtol=2**-7, atol=2e-3)


def test_rows_that_see_nothing_are_zero_not_nan(gen: torch.Generator) -> None:
    s = _sglang_state(gen, "bfloat16")
    s["topk"][:, 0] = -1  # row 0: every entry padding (SGLang's kernel gives NaN here)
    s["slot_ids"][1] = 99  # row 1: not a row of req_to_token
    out = _drop_in(s)
    assert (out[:2] == 0).all() and torch.isfinite(out).all()


def test_interior_minus_one_is_skipped(gen: torch.Generator) -> None:
    """SGLang requires front-packed lists; msa skips a -1 anywhere (a superset)."""
    s = _sglang_state(gen, "bfloat16")
    packed = _drop_in(s)
    s["topk"] = torch.cat([s["topk"][..., :1], torch.full_like(s["topk"][..., :1], -1), s["topk"][..., 1:]], dim=-1)
    torch.testing.assert_close(_drop_in(s).float(), packed.float(), rtol=0, atol=0)


def test_refusals(gen: torch.Generator) -> None:
    s = _sglang_state(gen, "bfloat16")
    with pytest.raises(msa.MSAUnsupportedError, match="^sink: msa has no attention sinks"):
        _drop_in(s, sink=torch.zeros(8, 64))
    with pytest.raises(msa.MSAUnsupportedError, match="^hisparse_slots"):
        _drop_in(s, hisparse_slots=torch.zeros(1))
    for page_size in (0, 24):
        with pytest.raises(msa.MSAUnsupportedError, match=r"^page_size: msa reads each sparse block as 16 consecutive slots"):
            _drop_in(s, page_size=page_size)
    with pytest.raises(msa.MSAInputError, match=r"^block_size: expected a power of two"):
        _drop_in(s, block_size=48)
    with pytest.raises(msa.MSAInputError, match=r"^k_cache: expected a \[slots, Hkv, D\] token pool"):
        _drop_in(s, k_cache=s["k_pool"].unsqueeze(0))
    # fp8 pools SGLang's kernel takes and msa does not read: unsupported (keep SGLang's kernel),
    # not invalid input (was MSAInputError)
    for dtype in (getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz") if hasattr(torch, n)):
        pools = {side: s[f"{side[0]}_pool"].to(dtype) for side in ("k_cache", "v_cache")}
        with pytest.raises(msa.MSAUnsupportedError, match=rf"^kv_cache: msa reads fp8 caches in float8_e4m3fn, not {dtype}"):
            _drop_in(s, **pools)


@pytest.mark.skipif(not INTERPRET, reason="the Triton backend runs on the CPU only under TRITON_INTERPRET=1")
def test_drop_in_through_the_triton_kernels(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSA_BACKEND", "triton")
    s = _sglang_state(gen, "fp8_e4m3")
    torch.testing.assert_close(_drop_in(s).float(), _reference(s).float(), rtol=2**-7, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3"])
def test_drop_in_on_gpu(layout: str, gen: torch.Generator) -> None:
    s = _sglang_state(gen, layout, page_size=128, batch=16, device="cuda")
    values = dict(kv_cache=pools_as_pages(s["k_pool"], s["v_pool"], BLOCK), v_scale=s["k_scale"] or 1.0)
    torch.testing.assert_close(_drop_in(s).float(), _reference(s).float(), rtol=2**-6, atol=gpu_atol(values))


@pytest.mark.skipif(not INTERPRET, reason="the table kernel runs on the CPU only under TRITON_INTERPRET=1")
def test_table_kernel_equals_the_torch_path(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-launch table against the whole-row torch gather: the same lengths and the same
    page at every block a request's length reaches, -1 beyond (invalid slots and lengths past
    max_context included)."""
    import msa.integrations.sglang as sglang

    s = _sglang_state(gen, "bfloat16", batch=5)
    s["slot_ids"][1] = 99  # not a row of req_to_token
    s["slot_ids"][2] = -3
    s["seq_lens"][3] = 10**6  # past max_context
    args = (s["req_to_token"], s["slot_ids"], s["seq_lens"].long(), BLOCK)
    table, lens = sglang._tables(*args)
    monkeypatch.setattr(sglang, "interpreting", lambda: False)
    full, full_lens = sglang._tables(*args)
    assert torch.equal(lens, full_lens) and lens.dtype == torch.int32
    assert torch.equal(table, full)
    assert (table[1] == -1).all() and (table[2] == -1).all() and lens[1] == lens[2] == 0


def test_the_layers_of_a_step_share_its_tables(gen: torch.Generator) -> None:
    """A step's tables are made once for all its layers: the same tensors (unchanged) give the
    same tables; a change in place through torch, or new tensors, give new ones — under
    torch.inference_mode() too, where new objects are what tells a new step."""
    from msa.integrations.sglang import step_tables

    s = _sglang_state(gen, "bfloat16", batch=3)
    args = [s["req_to_token"], s["slot_ids"], s["seq_lens"], BLOCK]
    first = step_tables(*args)
    assert step_tables(*args)[0] is first[0]
    s["seq_lens"].sub_(1)  # the next step, in place
    second = step_tables(*args)
    assert second[0] is not first[0] and torch.equal(second[1], (s["seq_lens"]).int())
    with torch.inference_mode():
        lens = s["seq_lens"].clone()
        args[2] = lens
        third = step_tables(*args)
        assert step_tables(*args)[0] is third[0]
        args[2] = lens.clone()
        assert step_tables(*args)[0] is not third[0]


# -- against SGLang's contract, read from SGLang's structures (tests/engine_oracles.py) -------------


def _oracle(s: dict[str, Any], **scales: Any) -> torch.Tensor:
    """Every selected token gathered through `req_to_token[slot_ids[b], pos]` from the pools."""
    return sglang_decode_oracle(s["q"], s["k_pool"], s["v_pool"], s["req_to_token"], s["seq_lens"], s["slot_ids"],
                                BLOCK, s["topk"], **scales)


@pytest.mark.parametrize("layout, page_size", [("bfloat16", BLOCK), ("bfloat16", 2 * BLOCK), ("fp8_e4m3", 4 * BLOCK),
                                               ("fp8_e4m3", 2 * BLOCK)])
def test_drop_in_equals_the_sglang_oracle(layout: str, page_size: int, gen: torch.Generator) -> None:
    """Pages of one or several sparse blocks handed out in any order; distinct q, k and v
    scales and an explicit sm_scale, as SGLang's attention layer passes them."""
    s = _sglang_state(gen, layout, page_size=page_size, batch=4)
    scales = dict(sm_scale=0.11, q_scale=0.75, k_scale=0.5, v_scale=1.5)
    out = _drop_in(s, **scales)
    assert_close_to_oracle(out, _oracle(s, **scales), f"{layout}, page_size={page_size}")
    assert_close_to_oracle(_drop_in(s, k_scale=None, v_scale=None), _oracle(s), f"{layout}, unit scales")


def test_seq_lens_past_max_context_equal_the_sglang_oracle(gen: torch.Generator) -> None:
    """SGLang clamps each length to `req_to_token`'s width."""
    max_context = 8 * BLOCK
    s = _sglang_state(gen, "bfloat16", lens=[max_context + 40, 5, max_context])
    assert int(s["seq_lens"][0]) > max_context
    assert_close_to_oracle(_drop_in(s), _oracle(s), "clamped lengths")


@pytest.mark.skipif(not INTERPRET, reason="the Triton backend runs on the CPU only under TRITON_INTERPRET=1")
def test_triton_drop_in_equals_the_sglang_oracle(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSA_BACKEND", "triton")
    s = _sglang_state(gen, "fp8_e4m3", page_size=2 * BLOCK)
    scales = dict(sm_scale=0.11, q_scale=0.75, k_scale=0.5, v_scale=1.5)
    assert_close_to_oracle(_drop_in(s, **scales), _oracle(s, **scales), "triton")


@pytest.mark.parametrize("kernel", [False, True])
def test_an_int64_slot_past_int32_stays_past_every_cache(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """An int64 `req_to_token` slot whose page does not fit int32 (2^36 + 16 with pages of 16) was
    cast to int32 and wrapped onto page 1, which was attended; it is a page past every cache now
    (skipped, as an int32 slot past the pool is), on the torch path and through the table kernel
    (under the interpreter on the CPU), with the same answer as a slot past the pool."""
    import msa.integrations.sglang as sglang

    if kernel and not INTERPRET:
        pytest.skip("the table kernel runs on the CPU only under TRITON_INTERPRET=1")
    monkeypatch.setattr(sglang, "interpreting", lambda: kernel)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(64, 1, 64, dtype=torch.bfloat16, generator=gen)  # a pool of 4 pages of 16 slots
    v = torch.randn(64, 1, 64, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(1, 2, 64, dtype=torch.bfloat16, generator=gen)
    topk, seq_lens, slot_ids = (torch.zeros(1, 1, 1, dtype=torch.int32), torch.tensor([16], dtype=torch.int32),
                                torch.tensor([0], dtype=torch.int32))
    outs = []
    for first in (2**36 + 16, -(2**36), 2**31 - 1):  # int64 past int32 either way; past the pool
        req_to_token = torch.full((1, 16), first, dtype=torch.int64)
        table, _ = sglang._tables(req_to_token, slot_ids, seq_lens, 16)
        assert table[0, 0] < 0 or table[0, 0] >= 4, table  # not a page of the pool
        outs.append(flash_decode_with_gqa_share_sparse(q, None, k, v, req_to_token, seq_lens, slot_ids, 16, topk,
                                                       page_size=16))
    assert all(torch.equal(out, torch.zeros_like(out)) for out in outs), outs  # nothing visible: zero rows
