"""What the `msa` parsers show (choices, defaults) that the library defines, copied here so that
building the parsers imports no torch: `msa --help` and a bad flag answer at once.

tests/test_cli_imports.py checks every copy against the library (`msa.layouts.LAYOUT_NAMES`,
`msa.problem.CACHE_FORMS` and `MINIMAX_M3`, `msa.platform.OPTIONAL_PACKAGES`).
"""

from __future__ import annotations

__all__ = [
    "LAYOUT_NAMES",
    "CACHE_FORMS",
    "OPTIONAL_PACKAGES",
    "M3_HEADS",
    "M3_HEAD_DIM",
    "M3_PAGE_SIZE",
    "M3_TOPK",
    "Q_DTYPES",
]

#: `msa.layouts.LAYOUT_NAMES`: every `kv_cache_dtype` name.
LAYOUT_NAMES: tuple[str, ...] = ("auto", "bfloat16", "bf16", "float16", "fp16", "fp8", "fp8_e4m3", "nvfp4")
#: `msa.problem.CACHE_FORMS`: how a cache may be held.
CACHE_FORMS: tuple[str, ...] = ("packed", "separate", "strided")
#: `msa.platform.OPTIONAL_PACKAGES`: the packages some backend depends on.
OPTIONAL_PACKAGES: tuple[str, ...] = ("triton", "fmha_sm100", "flashinfer", "cutlass_dsl")
#: `msa.problem.MINIMAX_M3`: (Hq, Hkv), D, P, K.
M3_HEADS: tuple[int, int] = (64, 4)
M3_HEAD_DIM = 128
M3_PAGE_SIZE = 128
M3_TOPK = 16
#: The query dtypes `msa explain --q-dtype` names, as attributes of `torch`.
Q_DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}
