"""A fake of MSA's `fmha_sm100` library: checks the adapter's calls, computes from its inputs."""

from __future__ import annotations

from typing import Any

import torch
from fake_attend import attend, check, check_lists

from msa.layouts import NVFP4

PLAN_CALLS: list[dict[str, Any]] = []
RUN_CALLS: list[dict[str, Any]] = []
ISSUED: list[Any] = []


def fmha_sm100_plan(qo_lens: torch.Tensor, kv_lens: torch.Tensor, num_qo_heads: int, **kw: Any) -> Any:
    check(qo_lens.device.type == "cpu" and qo_lens.dtype == torch.int32, "qo_lens: CPU int32")
    check(kv_lens.device.type == "cpu" and kv_lens.dtype == torch.int32, "kv_lens: CPU int32")
    b = qo_lens.shape[0]
    check(kv_lens.shape == (b,), "kv_lens shape")
    length = int(qo_lens[0])
    check(bool((qo_lens == length).all()), "uniform query length")
    check(torch.equal(kw["qo_offset"], kv_lens - qo_lens), "qo_offset = kv_lens - qo_lens")
    expected = {"page_size": 128, "kv_block_num": 16, "causal": True, "output_maxscore": False,
                "sparse_kernel_mode": "decode", "split_prefill_decode": False}
    for name, value in expected.items():
        check(kw.get(name) == value, f"{name}={kw.get(name)!r}, expected {value!r}")
    nvfp4 = kw.get("kv_dtype") == "nvfp4"
    check(kw["use_fp8_kvcache"] == (not nvfp4), "use_fp8_kvcache agrees with kv_dtype")
    check(1 <= kw["num_kv_heads"] <= 4 and num_qo_heads <= 64, "head limits")
    rows = b * length
    check(rows * num_qo_heads <= 65536, "row budget")
    device = kw["device"]
    k = kw["kv_block_num"]
    decode = {
        # the library's own layout: each row owns kv_block_num consecutive page slots
        "kv_page_indptr": torch.arange(rows + 1, dtype=torch.int32, device=device) * k,
        "kv_segment_lens": torch.full((rows,), k * 128, dtype=torch.int32, device=device),
        "qo_offset": torch.zeros(rows, dtype=torch.int32, device=device),
        "qo_segment_lens": torch.ones(rows, dtype=torch.int32, device=device),
        "num_rows": rows,
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": kw["num_kv_heads"],
        "kv_dtype": "nvfp4" if nvfp4 else "fp8",
    }
    plan = (False, False, b, decode, None)
    PLAN_CALLS.append(dict(kw, qo_lens=qo_lens.clone(), kv_lens=kv_lens.clone(), plan=plan))
    ISSUED.append(plan)
    return plan


def fmha_sm100(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: Any, **kw: Any) -> Any:
    check(any(plan is p for p in ISSUED), "plan: not one fmha_sm100_plan returned")
    decode = plan[3]
    rows, hq, d = q.shape
    check(q.dtype == torch.float8_e4m3fn, f"q: fp8 expected, got {q.dtype}")
    check(rows == decode["num_rows"] and hq == decode["num_qo_heads"], "q shape vs plan")
    hkv = decode["num_kv_heads"]
    pages, heads, p, width = key.shape
    check(heads == hkv and p == 128, "key view shape")
    if decode["kv_dtype"] == "nvfp4":
        check(key.dtype == torch.uint8 and width == d // 2 + d // 16, "nvfp4 slot view")
        check(key.stride() == (2 * hkv * p * width, 2 * p * width, width, 1), f"K slot strides {key.stride()}")
        check(value.stride() == key.stride(), "V slot strides")
        check(value.data_ptr() - key.data_ptr() == p * width, "V slot follows K slot")
        for name in ("k_scale", "v_scale"):
            s = kw[name]
            check(isinstance(s, torch.Tensor) and s.numel() == 1 and s.dtype == torch.float32, f"{name}: global-scale tensor")
    else:
        check(key.dtype == torch.float8_e4m3fn and width == d, "fp8 K view")
        check(key.stride() == (hkv * p * 2 * d, p * 2 * d, 2 * d, 1), f"K view strides {key.stride()}")
        check(value.stride() == key.stride() and value.data_ptr() - key.data_ptr() == d, "V view = K view + D")
        check(isinstance(kw["k_scale"], float) and isinstance(kw["v_scale"], float), "fp8 scales are floats")
    table = kw["kv_indices"]
    check(table.dim() == 1 and table.dtype == torch.int32, "kv_indices: flat int32")
    ids = kw["kv_block_indexes"]
    check(ids.dtype == torch.int32 and ids.is_contiguous() and ids.shape == (rows, hkv, 16), "kv_block_indexes: [R, Hkv, 16] contiguous")
    check_lists(ids, "kv_block_indexes")
    out = kw["out"]
    check(out.dtype == torch.bfloat16 and out.is_contiguous() and out.shape == (rows, hq, d), "out")
    check(kw["output_maxscore"] is False and kw["output_o"] is True and kw["o_scale"] == 1.0, "flags")
    indptr, kv_lens, q_pos = decode["kv_page_indptr"], decode["kv_segment_lens"], decode["qo_offset"]
    spec: list[list[tuple[list[int], list[int], int]]] = []
    for r in range(rows):
        n = min(int(q_pos[r]) + 1, int(kv_lens[r]))  # causal, within the segment
        per_head = []
        for h in range(hkv):
            blocks = [j for j in ids[r, h].tolist() if j >= 0]
            page_ids = [int(table[int(indptr[r]) + j]) for j in blocks]
            check(all(0 <= pg < pages for pg in page_ids), f"row {r}: page outside the cache")
            check(all(j * 128 < n for j in blocks), f"row {r}: block past the visible tokens")
            per_head.append((blocks, page_ids, n))
        spec.append(per_head)

    def dequant(page_ids: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        if decode["kv_dtype"] == "nvfp4":
            slots = torch.stack((key[page_ids, h], value[page_ids, h]), dim=1)  # [n, 2, P, W]
            return NVFP4.gather(slots, torch.arange(len(page_ids)), torch.zeros(1, dtype=torch.long),
                                k_scale=kw["k_scale"], v_scale=kw["v_scale"])
        return key[page_ids, h].float() * kw["k_scale"], value[page_ids, h].float() * kw["v_scale"]

    result, _ = attend(q.float(), kw["sm_scale"] * kw["q_scale"], dequant, spec, hkv)
    out.copy_(result.to(out.dtype))
    RUN_CALLS.append(dict(kw, q=q, plan=plan))
    return out, None
