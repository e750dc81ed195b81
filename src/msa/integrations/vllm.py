"""A drop-in for vLLM's MiniMax-M3 Triton decode, `minimax_m3_sparse_attn_decode`, running msa.

    # vllm/models/minimax_m3/common/sparse_attention.py, MiniMaxM3SparseTritonImpl.forward:
    from msa.integrations.vllm import minimax_m3_sparse_attn_decode

The signature is vLLM's (0.33.0's eleven parameters, in order, plus `query_start_loc` and
`token_to_req_indices` of vLLM's main branch for ragged batches); the contract is vLLM's:

- `q` `[total_q, Hq, D]` bf16/fp16, rows request-major (`decode_query_len` rows per request).
- `kv_cache` `[num_blocks, Hkv, 128, 2D]` packed K then V, any strides with a unit last one
  (vLLM's NHD-strided view included), bf16/fp16 or fp8 e4m3 (e5m2 and fnuz are refused); an
  fp8 cache may come as its uint8 storage (vLLM allocates fp8 caches as uint8), read as e4m3.
- `topk_idx` int32 `[Hkv, total_q, K]`: block ids, any strides (vLLM passes the transpose of its
  token-major buffer).
- `block_table` int32 `[num_reqs, max_blocks]`; `seq_lens` int32 `[num_reqs]` including the new
  tokens; `num_kv_heads` = Hkv; `sm_scale` a float.
- `output` `[total_q, Hq, D]`, written in place; the function returns None.
- `k_scale` / `v_scale`: both None or both given, one-element float tensors of any shape on the
  output's device (read as fp32, as vLLM reads them); read only for fp8 caches (as in vLLM).
  vLLM's per-slot scale mode (two `[Hkv, max_kv_tokens]` tensors) is refused with
  `MSAUnsupportedError`.
- ragged batches: `query_start_loc` int32 `[num_reqs + 1]` (request `r` owns rows
  `[qsl[r], qsl[r+1])`; rows at or past `qsl[num_reqs]` are padding) with
  `token_to_req_indices` (each row's request, at least `total_q` long). As in vLLM,
  `decode_query_len` is not used then; msa takes each request's length from
  `query_start_loc` and derives the row -> request map itself. At most 32 rows per request
  (`RAGGED_MAX_QUERY_LEN`, the kernels' limit): a longer request is outside this contract and is
  NOT refused by default (seeing it would read `query_start_loc` on the host every call): msa
  caps it at 32 rows, as semantics §3.2 reads a malformed `query_start_loc`, and the step's later
  rows shift, a wrong answer. `MSA_VALIDATE=1` refuses such a step with `MSAInputError`.

msa's semantics are a superset of vLLM's on these inputs: `-1` and out-of-range ids anywhere in
a list are skipped (vLLM reads only the first `ceil(n / 128)` list positions), negative pages
are skipped (vLLM reads them), and a row that attends nothing gives zeros (vLLM's gives NaN).

Called eagerly once per layer with the same step metadata, msa plans the step once: the first
layer's call refreshes the per-row metadata and later layers reuse it (see
`msa.sparse_decode`).
"""

from __future__ import annotations

import torch

from msa.api import sparse_decode
from msa.errors import MSAInputError, MSAUnsupportedError, is_int
from msa.layouts import refuse_unread_fp8
from msa.validation import check_dims

__all__ = ["minimax_m3_sparse_attn_decode", "RAGGED_MAX_QUERY_LEN"]

#: The query tokens per request msa serves in a ragged step (the Triton kernels' limit).
RAGGED_MAX_QUERY_LEN = 32


def _scales(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, fp8: bool
) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    if (k_scale is None) != (v_scale is None):
        raise MSAInputError("k_scale / v_scale", "both None or both given", "one of them")
    if k_scale is None or v_scale is None or not fp8:
        return 1.0, 1.0  # vLLM reads the scales only for fp8 caches
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(scale, torch.Tensor) and scale.dim() == 2 and scale.numel() > 1:
            raise MSAUnsupportedError(
                f"{name}: msa takes one scale per cache side (a one-element float tensor); vLLM's per-slot "
                f"[Hkv, max_kv_tokens] scales (shape {tuple(scale.shape)}) are not supported"
            )
        if isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.is_floating_point():
            # vLLM reads any one-element float tensor as the side's scale, whatever its shape or
            # float dtype; msa takes it as one fp32 element (no copy for an fp32 one)
            scale = scale.reshape(1).to(torch.float32)
        scales.append(scale)
    return scales[0], scales[1]


def minimax_m3_sparse_attn_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_idx: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    sm_scale: float,
    output: torch.Tensor,
    decode_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    token_to_req_indices: torch.Tensor | None = None,
) -> None:
    """vLLM's MiniMax-M3 sparse decode on msa, into `output` (see the module docstring).

    Raises:
        MSAInputError: an argument breaks vLLM's contract (named, with what was expected).
        MSAUnsupportedError: per-slot scales, or an fp8 cache msa does not read (e5m2, fnuz).
    """
    q = check_dims("q", q, 3, "a 3-D tensor [total_q, Hq, D]")
    if not isinstance(output, torch.Tensor):  # (vLLM's caller owns the result: it is written in place)
        raise MSAInputError("output", "a tensor [total_q, Hq, D], written in place", type(output).__name__)
    if not is_int(num_kv_heads):
        raise MSAInputError("num_kv_heads", "an int", repr(num_kv_heads))
    if not isinstance(kv_cache, torch.Tensor):
        raise MSAInputError("kv_cache", "a torch.Tensor [num_blocks, Hkv, 128, 2D]", type(kv_cache).__name__)
    if kv_cache.dtype == torch.uint8 and kv_cache.dim() == 4 and kv_cache.shape[-1] == 2 * q.shape[-1]:
        kv_cache = kv_cache.view(torch.float8_e4m3fn)  # vLLM keeps fp8 caches in uint8 storage
    refuse_unread_fp8("kv_cache", kv_cache)
    if kv_cache.dim() != 4 or kv_cache.shape[1] != num_kv_heads:
        raise MSAInputError(
            "num_kv_heads", f"the KV heads of kv_cache [num_blocks, Hkv, 128, 2D] (shape {tuple(kv_cache.shape)})",
            repr(num_kv_heads),
        )
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    k, v = _scales(k_scale, v_scale, fp8)
    length = decode_query_len
    if query_start_loc is not None:
        if (not isinstance(token_to_req_indices, torch.Tensor) or token_to_req_indices.dim() != 1
                or token_to_req_indices.shape[0] < q.shape[0]):
            raise MSAInputError(
                "token_to_req_indices", f"a 1-D tensor of at least total_q = {q.shape[0]} entries with query_start_loc",
                "None" if token_to_req_indices is None else f"shape {tuple(token_to_req_indices.shape)}",
            )
        length = max(1, min(q.shape[0], RAGGED_MAX_QUERY_LEN))
    sparse_decode(
        q, kv_cache, topk_idx, block_table, seq_lens,
        decode_query_len=length, sm_scale=sm_scale, k_scale=k, v_scale=v, out=output,
        query_start_loc=query_start_loc,
    )
