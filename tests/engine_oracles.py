"""Independent float64 oracles of the serving engines' own decode contracts, for the drop-ins'
tests (tests/test_vllm.py, tests/test_sglang.py) and the conformance tests against the engines'
real Python code (tests/conformance/).

Each oracle reads the engine's structures the way the engine's kernel does, token by token, and
shares nothing with msa: not its block-table derivation (`msa.integrations.sglang.sglang_block_table`),
not its cache views (`pools_as_pages`), not its reference backend or its semantics module. A row
that attends to no key comes out as zeros (the engines' kernels give NaN there: undefined).
"""

from __future__ import annotations

import torch


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64 for one row and one KV head's query heads."""
    if keys.shape[0] == 0:
        return torch.zeros((q.shape[0], values.shape[-1]), dtype=torch.float64)
    p = torch.softmax((q @ keys.T) * scale, dim=-1)
    return p @ values


def _scale(value: float | torch.Tensor | None) -> float:
    return 1.0 if value is None else float(value.reshape(()) if isinstance(value, torch.Tensor) else value)


def vllm_decode_oracle(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_idx: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    decode_query_len: int,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    query_start_loc: torch.Tensor | None = None,
    token_to_req_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """What vLLM's `minimax_m3_sparse_attn_decode` computes, as `[total_q, Hq, D]` float64.

    vLLM's contract, read from its structures: row `r` belongs to request `r // decode_query_len`
    (ragged: `token_to_req_indices[r]`, its place in the request from `query_start_loc`; rows
    at or past `query_start_loc[-1]` are padding); its query sits at position
    `seq_lens[b] - L_b + i` and sees positions up to it. Of `topk_idx[h, r]` the kernel reads the
    first `min(K, ceil(kv_len / P))` entries and skips ids outside `[0, ceil(kv_len / P))`;
    block `j` is page `block_table[b, j]`, whose token `o` (position `j * P + o`) has its key at
    `kv_cache[page, h, o, :D]` and its value at `kv_cache[page, h, o, D:]`, scaled by
    `k_scale` / `v_scale` for fp8 caches only.
    """
    total_q, hq, d = q.shape
    hkv, page = kv_cache.shape[1], kv_cache.shape[2]
    group = hq // hkv
    if kv_cache.dtype == torch.uint8:  # vLLM's storage of an fp8 e4m3 cache
        kv_cache = kv_cache.view(torch.float8_e4m3fn)
    fp8 = kv_cache.dtype.itemsize == 1
    ks, vs = (_scale(k_scale), _scale(v_scale)) if fp8 else (1.0, 1.0)
    out = torch.zeros((total_q, hq, d), dtype=torch.float64)
    for r in range(total_q):
        if query_start_loc is None:
            b, length, i = r // decode_query_len, decode_query_len, r % decode_query_len
        else:
            if r >= int(query_start_loc[-1]):
                continue  # padding
            b = int(token_to_req_indices[r]) if token_to_req_indices is not None else -1
            start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
            assert start <= r < end, f"row {r}: token_to_req_indices says request {b}, query_start_loc disagrees"
            length, i = end - start, r - start
        kv_len = max(int(seq_lens[b]) - length + i + 1, 0)
        visible = -(-kv_len // page)
        for h in range(hkv):
            ids = [j for j in topk_idx[h, r, : min(topk_idx.shape[-1], visible)].tolist() if 0 <= j < visible]
            positions = [j * page + o for j in ids for o in range(page) if j * page + o < kv_len]
            pages = [int(block_table[b, p // page]) for p in positions]
            offsets = [p % page for p in positions]
            rows = kv_cache[pages, h, offsets].double() if positions else kv_cache.new_zeros((0, 2 * d)).double()
            out[r, h * group:(h + 1) * group] = _attend(
                q[r, h * group:(h + 1) * group].double(), rows[:, :d] * ks, rows[:, d:] * vs, sm_scale)
    return out


def sglang_decode_oracle(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_ids: torch.Tensor,
    block_size: int,
    topk_idx: torch.Tensor,
    sm_scale: float | None = None,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> torch.Tensor:
    """What SGLang's `flash_decode_with_gqa_share_sparse` computes, as `[B, Hq, D]` float64.

    SGLang's contract, read from its structures: row `b` is request slot `slot_ids[b]` of
    `req_to_token`, its KV length `min(seq_lens[b], max_context)`; its selected blocks are the
    non-negative ids of `topk_idx[h, b]` (front-packed); block `j`'s token at position
    `pos = j * block_size + o < kv_len` lives in slot `req_to_token[slot_ids[b], pos]` of the
    `[slots, Hkv, D]` pools. Logits are `q . k * sm_scale * q_scale * k_scale` (sm_scale
    defaulting to `D ** -0.5`), values scaled by `v_scale`. A `slot_ids` entry outside
    `req_to_token` attends nothing (undefined in SGLang).
    """
    batch, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    max_reqs, max_context = req_to_token.shape
    scale = (d**-0.5 if sm_scale is None else sm_scale) * _scale(q_scale) * _scale(k_scale)
    vs = _scale(v_scale)
    out = torch.zeros((batch, hq, d), dtype=torch.float64)
    for b in range(batch):
        sid = int(slot_ids[b])
        if not 0 <= sid < max_reqs:
            continue
        kv_len = min(int(seq_lens[b]), max_context)
        for h in range(hkv):
            ids = [j for j in topk_idx[h, b].tolist() if j >= 0]
            positions = [j * block_size + o for j in ids for o in range(block_size) if j * block_size + o < kv_len]
            slots = req_to_token[sid, positions].long() if positions else torch.zeros(0, dtype=torch.long)
            out[b, h * group:(h + 1) * group] = _attend(
                q[b, h * group:(h + 1) * group].double(), k_cache[slots, h].double(), v_cache[slots, h].double() * vs,
                scale)
    return out


def assert_close_to_oracle(out: torch.Tensor, oracle: torch.Tensor, what: str) -> None:
    """`out` (bf16/fp16, fp32 accumulation) within rounding of the float64 oracle, every row
    written: 1/128 relative (bf16) plus 4e-3 absolute, scaled by the output's magnitude."""
    assert not torch.isnan(out).any(), f"{what}: rows left unwritten (NaN)"
    bound = max(1.0, float(oracle.abs().max())) if oracle.numel() else 1.0
    torch.testing.assert_close(out.double(), oracle, rtol=2**-7, atol=4e-3 * bound, msg=lambda m: f"{what}: {m}")


