"""The `cute` backend (CuTe DSL NVFP4 kernel): its launch rules everywhere; its kernel, on a GPU of
compute capability >= 9.0 with `nvidia-cutlass-dsl` installed, against the independent float64
loop on poisoned hostile steps (every byte the contract says is never read is NaN), through the
planner, and inside a CUDA graph."""

from __future__ import annotations

import ctypes
import dataclasses
import operator
import os
import random
import re
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from cases import assert_close_to_naive, gpu_atol
from hostile import make_hostile
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from ptx_same import compile_sm90a as _compile_sm90a
from test_fuzz import step_params

import msa
from msa.backends.cute import CuteBackend, fastcall, launch
from msa.backends.cute.config import (
    AUTO_MIN_PROGRAMS,
    CTAS_PER_SM,
    DEFAULT_MIN_CTAS,
    HOST_ARG_KINDS,
    SM90_SMEM,
    VERIFIED_DSL_VERSIONS,
    WGMMA_SHARED_ROWS_WGS,
    WIDE_MIN_CTAS,
    CuteConfig,
    WgmmaShape,
    choose_min_ctas,
    choose_splits,
    choose_wgmma_shape,
    choose_wgmma_splits,
    programs,
    wgmma_cluster,
    wgmma_ctas_per_sm,
    wgmma_heads,
    wgmma_programs,
    wgmma_q_bytes,
    wgmma_serves,
    wgmma_slots,
    wgmma_smem_bytes,
    wgmma_tokens_serve,
)
from msa.errors import MSAInputError
from msa.planning import StepTables
from msa.platform import Platform, package_installed
from msa.problem import DecodeProblem, Geometry
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

HAVE_DSL = package_installed("cutlass_dsl")
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
needs_kernel = pytest.mark.skipif(not (HAVE_DSL and ON_HOPPER),
                                  reason="needs nvidia-cutlass-dsl and a GPU of compute capability >= 9.0")


def _problem(batch: int, query_len: int = 1, geometry: Geometry = msa.MINIMAX_M3,
             graph_capture: bool = True) -> DecodeProblem:
    return DecodeProblem(geometry=geometry, batch_size=batch, query_len=query_len, kv_layout="nvfp4",
                         q_dtype=torch.bfloat16, out_dtype=torch.bfloat16, device_type="cuda", num_pages=0,
                         max_blocks=0, graph_capture=graph_capture)


def _hopper() -> Platform:
    return Platform(device_type="cuda", capability=(9, 0), sm_count=132, packages=frozenset({"cutlass_dsl", "triton"}))


@pytest.mark.parametrize("batch", [1, 2, 8, 33, 64, 256, 1000])
@pytest.mark.parametrize("sms", [1, 132, 148])
def test_splits_fill_the_slots_once_and_keep_warps_busy(batch: int, sms: int) -> None:
    problem = _problem(batch)
    splits = choose_splits(problem, sms)
    g = problem.geometry
    assert 1 <= splits <= g.topk * g.page_size // (4 * 16 * 4)
    if splits > 1:  # more splits only while one wave of CTAs still fits
        assert programs(problem) * splits <= CTAS_PER_SM * sms


def _fp8(batch: int, geometry: Geometry = msa.MINIMAX_M3, query_len: int = 1) -> DecodeProblem:
    return attrs.evolve(_problem(batch, query_len, geometry=geometry), kv_layout="fp8_e4m3")


def _wide(batch: int, layout: str = "bfloat16", geometry: Geometry = msa.MINIMAX_M3) -> DecodeProblem:
    q_dtype = torch.float16 if layout == "float16" else torch.bfloat16
    return attrs.evolve(_problem(batch, geometry=geometry), kv_layout=layout, q_dtype=q_dtype, out_dtype=q_dtype)


def test_the_wgmma_kernel_serves_fp8_nvfp4_and_16_bit_caches_on_sm90_with_pages_of_64_tokens() -> None:
    assert wgmma_serves(_fp8(8), (9, 0)) is None
    assert wgmma_serves(_problem(8), (9, 0)) is None
    assert wgmma_serves(_wide(8), (9, 0)) is None
    assert wgmma_serves(_wide(8, "float16"), (9, 0)) is None
    assert "sm_90a" in (wgmma_serves(_fp8(8), (10, 0)) or "")
    assert "sm_90a" in (wgmma_serves(_fp8(8), None) or "")
    assert "fp16" in (wgmma_serves(attrs.evolve(_fp8(8), kv_layout="fp16"), (9, 0)) or "")
    small_pages = Geometry(num_q_heads=16, num_kv_heads=2, head_dim=128, page_size=32, topk=8)
    assert "page size 32" in (wgmma_serves(_fp8(8, small_pages), (9, 0)) or "")
    backend = CuteBackend()
    assert backend.kernel_for(_fp8(8), _hopper()) == "wgmma"
    assert backend.kernel_for(_problem(8), _hopper()) == "wgmma"
    assert backend.kernel_for(_fp8(8, small_pages), _hopper()) == "mma"
    assert backend.kernel_for(_problem(8, geometry=small_pages), _hopper()) == "mma"
    assert CuteBackend(kernel="mma").kernel_for(_problem(8), _hopper()) == "mma"
    assert CuteBackend(kernel="mma").kernel_for(_fp8(8), _hopper()) == "mma"
    assert backend.kernel_for(_wide(8), _hopper()) == "wgmma"


@pytest.mark.parametrize("layout", ["bfloat16", "float16"])
def test_16_bit_caches_are_the_wgmma_kernels_and_auto_takes_the_measured_band(layout: str) -> None:
    """bf16 and f16 caches: only the wgmma kernel reads them (the mma kernel, asked for, or a GPU or
    page size the wgmma kernel cannot serve, is refused with why); `auto` chooses the backend for
    them where it measured faster than Triton (`config.WGMMA_AUTO_16_BIT`: one query row, groups of
    8, a one-term query, from 16 programs) and says why elsewhere, while a request by name runs every step."""
    backend = CuteBackend()
    tp8, tp4 = msa.MINIMAX_M3_TP[8], msa.MINIMAX_M3_TP[4]
    assert not backend.problem_reasons(_wide(8, layout), _hopper(), requested=True)
    assert not backend.problem_reasons(_wide(16, layout, tp8), _hopper())  # 16 programs of 8 heads
    assert not backend.problem_reasons(_wide(256, layout, tp8), _hopper())
    few = backend.problem_reasons(_wide(15, layout, tp8), _hopper())
    assert any("fewer than 16 (row, KV head, head chunk) programs of 8 heads" in r for r in few), few
    other_q = torch.bfloat16 if layout == "float16" else torch.float16  # one term (fitted) / two terms
    group4 = Geometry(num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=128, topk=16)
    assert (not backend.problem_reasons(attrs.evolve(_wide(64, layout, tp8), q_dtype=other_q), _hopper())) == (
        layout == "float16")
    for problem in (_wide(64, layout, tp4), _wide(64, layout), attrs.evolve(_wide(64, layout, tp8), query_len=2),
                    _wide(64, layout, group4)):
        reasons = backend.problem_reasons(problem, _hopper())
        assert any(f"auto: a {layout} cache's steps only with one query row a step, 8 query heads a KV head"
                   in r for r in reasons), reasons
        assert not backend.problem_reasons(problem, _hopper(), requested=True)
    small_pages = Geometry(num_q_heads=16, num_kv_heads=2, head_dim=128, page_size=32, topk=8)
    blackwell = attrs.evolve(_hopper(), capability=(10, 0))
    for chosen, problem, platform, why in ((backend, _wide(8, layout, small_pages), _hopper(), "page size 32"),
                                           (backend, _wide(8, layout), blackwell, "sm_90a"),
                                           (CuteBackend(kernel="mma"), _wide(8, layout), _hopper(), "kernel='mma'")):
        reasons = chosen.problem_reasons(problem, platform, requested=True)
        assert any(f"a {layout} cache is read by the wgmma kernel only" in r and why in r for r in reasons), reasons
        with pytest.raises(MSAInputError, match=f"kv_cache_dtype: .*{why}"):  # (a direct configuration call)
            chosen.config_on(problem, platform)
        assert why in (chosen.strategy(problem, platform) or "")


@pytest.mark.parametrize(("batch", "stages", "splits"), [(1, 3, 8), (16, 3, 4), (64, 3, 1), (66, 3, 1), (67, 2, 1),
                                                          (256, 2, 1)])
def test_a_16_bit_step_takes_one_warpgroup_reading_its_ring_as_stored(batch: int, stages: int, splits: int) -> None:
    """3 stages while the programs fit 2 CTAs an SM (shared memory: 2 x 16 KiB a stage), else 2;
    splits filling the SMs once, 4 tiles a split at least; no register operands, no `lag`."""
    for layout in ("bfloat16", "float16"):
        problem = _wide(batch, layout)
        assert wgmma_ctas_per_sm(3, 1, False, "bf16") == 2 and wgmma_ctas_per_sm(2, 1, False, "bf16") == 3
        assert choose_wgmma_shape(problem, 132) == WgmmaShape(splits, stages, 1, False, False)
        config = CuteBackend().config_on(problem, _hopper())
        assert (config.kernel, config.num_splits, config.stages, config.vreg, config.kreg, config.tconv,
                config.lag, config.cluster) == ("wgmma", splits, stages, False, False, False, False, False)
        assert "from the ring as stored" in (CuteBackend().strategy(problem, _hopper()) or "")
    # shared memory holds the query's terms: two bf16 ones of an f16 query take 2 stages to 2 CTAs an SM
    f16_q = attrs.evolve(_wide(64), q_dtype=torch.float16)
    assert wgmma_slots(f16_q, 132, 2, 1, False) == 2 * 132 and wgmma_slots(_wide(64), 132, 2, 1, False) == 3 * 132


@pytest.mark.parametrize("option", [{"vreg": True}, {"kreg": True}, {"tconv": True}, {"lag": True},
                                    {"refill": "late"}])
def test_16_bit_steps_refuse_the_options_of_decoded_operands(option: dict[str, Any]) -> None:
    name = next(iter(option))
    with pytest.raises(MSAInputError, match=name):
        CuteBackend(**option).config_on(_wide(64), _hopper())


@pytest.mark.parametrize("requested", [False, True])
def test_a_requested_wgmma_kernel_refuses_the_steps_it_cannot_serve(requested: bool) -> None:
    """`kernel="wgmma"` on a step the kernel cannot run is refused when the backend is chosen, with
    the reason (not at compile or launch time); the default `cute` falls back to the mma kernel."""
    small_pages = Geometry(num_q_heads=16, num_kv_heads=2, head_dim=128, page_size=32, topk=8)
    blackwell = attrs.evolve(_hopper(), capability=(10, 0))
    for problem, platform, why in ((_fp8(8, small_pages), _hopper(), "page size 32"),
                                   (_problem(8, geometry=small_pages), _hopper(), "page size 32"),
                                   (_fp8(8), blackwell, "sm_90a")):
        reasons = CuteBackend(kernel="wgmma").problem_reasons(problem, platform, requested=requested)
        assert any("kernel='wgmma'" in r and why in r for r in reasons), reasons
        assert not any("kernel='wgmma'" in r for r in CuteBackend().problem_reasons(problem, platform,
                                                                                    requested=requested))
    assert not CuteBackend(kernel="wgmma").problem_reasons(_problem(8), _hopper(), requested=True)


@pytest.mark.parametrize(("option", "value", "expected"), [
    ("num_splits", 0, "an int >= 1"), ("stages", 0, "an int >= 1"), ("stages", 2.5, "an int >= 1"),
    ("min_ctas", -1, "an int >= 0"), ("qk_chains", 3, "the int 1, 2 or 4"), ("wgs", 3, "the int 1 or 2"),
    ("wgs", 0, "the int 1 or 2"), ("lag", 1, "a bool"), ("vreg", "yes", "a bool"), ("fused", 0, "a bool"),
    ("kreg", 1, "a bool"), ("tconv", "no", "a bool"), ("cluster", 1, "a bool"),
    ("tokens", 3, "an int, one of (1, 2, 4)"), ("tokens", 0, "an int, one of (1, 2, 4)"),
    # floats and bools equal to a valid int (2.0 in (1, 2); True == 1) reached the DSL as they were
    ("wgs", 2.0, "the int 1 or 2"), ("tokens", 4.0, "an int, one of (1, 2, 4)"), ("qk_chains", 2.0, "the int 1, 2 or 4"),
    ("stages", True, "an int >= 1"), ("num_splits", True, "an int >= 1"), ("min_ctas", True, "an int >= 0"),
    ("evict", "sometimes", "one of 'normal', 'first', 'last'"), ("evict", 1, "one of 'normal', 'first', 'last'"),
    ("refill", "early", "one of 'top', 'late'"), ("refill", True, "one of 'top', 'late'")])
def test_backend_options_outside_what_the_kernels_take_are_refused(option: str, value: object,
                                                                   expected: str) -> None:
    with pytest.raises(MSAInputError, match=rf"^{option}: expected {re.escape(expected)}, got {re.escape(repr(value))}"):
        CuteBackend(**{option: value})


def test_wgmma_shapes_the_step_cannot_run_are_refused_when_planned() -> None:
    """Options each valid alone but not for the step's kernel: one stage (the ring keeps a tile in
    flight), more stages than an SM's shared memory holds, NVFP4 values not in registers; the
    mma kernel's stages past its shared-memory budget."""
    cpu = torch.device("cpu")
    with pytest.raises(MSAInputError, match=r"^stages: expected at least 2"):
        CuteBackend(kernel="wgmma", stages=1).config_for(_fp8(64), cpu)
    with pytest.raises(MSAInputError, match=r"^stages: expected few enough .* 2 warpgroups need \d+ bytes"):
        CuteBackend(kernel="wgmma", stages=7, wgs=2).config_for(_fp8(64), cpu)
    with pytest.raises(MSAInputError, match=r"^vreg: expected True \(or None\) for nvfp4"):
        CuteBackend(kernel="wgmma", vreg=False).config_for(_problem(64), cpu)
    with pytest.raises(MSAInputError, match=r"^kreg: expected True \(or None\) for nvfp4"):
        CuteBackend(kernel="wgmma", kreg=False).config_for(_problem(64), cpu)
    with pytest.raises(MSAInputError, match=r"^stages: expected at most 4 for the mma kernel on nvfp4"):
        CuteBackend(kernel="mma", stages=5).config_for(_problem(64), cpu)
    with pytest.raises(MSAInputError, match=r"^tconv: expected False \(or None\) for nvfp4"):
        CuteBackend(kernel="wgmma", tconv=True).config_for(_problem(64), cpu)
    with pytest.raises(MSAInputError, match=r"^kreg: expected True \(or None\) with tconv"):
        CuteBackend(kernel="wgmma", tconv=True, kreg=False).config_for(_fp8(64), cpu)
    tconv = CuteBackend(kernel="wgmma", tconv=True).config_for(_fp8(256), cpu)
    assert tconv.tconv and tconv.kreg
    tp8 = _fp8(16, msa.MINIMAX_M3_TP[8])  # values in registers by default, keys too (kreg=False: the fp8 product)
    default = CuteBackend(kernel="wgmma").config_on(tp8, _hopper())
    assert default.vreg and default.kreg and not default.tconv
    fp8_product = CuteBackend(kernel="wgmma", kreg=False).config_on(tp8, _hopper())
    assert fp8_product.vreg and not fp8_product.kreg and not fp8_product.tconv
    assert CuteBackend(kernel="wgmma", stages=6).config_for(_fp8(64), cpu).stages == 6
    config = CuteBackend(kernel="wgmma").config_for(_problem(64), cpu)
    assert config.vreg and config.kreg


def test_programs_of_several_rows_need_a_uniform_step_they_divide_and_a_group_of_8_or_16() -> None:
    """`tokens` > 1 (a program walks the union of several rows' pages): refused, naming the option
    and why, for a ragged step, a query length it does not divide, a group other than 8 / 16 or
    more than 32 columns, and `lag`; taken otherwise, with that many times fewer programs and the
    columns of all its rows."""
    cpu = torch.device("cpu")
    tp8, tp1 = msa.MINIMAX_M3_TP[8], msa.MINIMAX_M3
    ragged = attrs.evolve(_fp8(16, tp8), query_len=4, ragged=True, total_rows=40)
    for problem, tokens, why in ((ragged, 2, "not a ragged one"), (_fp8(16, tp8, 3), 2, "not L = 3"),
                                 (_fp8(16, tp1, 4), 4, "at most 32"),
                                 (_fp8(16, Geometry(num_q_heads=20, num_kv_heads=1, head_dim=128, page_size=128,
                                                    topk=16), 2), 2, "group of 20")):
        with pytest.raises(MSAInputError, match=rf"^tokens: expected rows a wgmma program can take together \(.*{why}"):
            CuteBackend(kernel="wgmma", tokens=tokens).config_for(problem, cpu)
    with pytest.raises(MSAInputError, match=r"^lag: expected False \(or None\) with tokens > 1"):
        CuteBackend(kernel="wgmma", tokens=2, lag=True).config_for(_fp8(16, tp8, 4), cpu)
    config = CuteBackend(kernel="wgmma", tokens=4).config_on(_fp8(16, tp8, 4), _hopper())
    assert config.tokens == 4 and config.tconv  # 32 columns: the keys converted on the tensor cores
    assert wgmma_programs(_fp8(16, tp8, 4), 4) * 4 == wgmma_programs(_fp8(16, tp8, 4))
    assert "2 rows of a request a program" in (CuteBackend(tokens=2).strategy(_fp8(16, tp1, 4), _hopper()) or "")
    assert wgmma_tokens_serve(_fp8(16, tp1, 2), 2) is None


#: The shape `choose_wgmma_shape` gives fp8 steps of several rows a request at one to two programs an SM.
_SHARED_ROWS_SHAPE = WgmmaShape(1, 2, WGMMA_SHARED_ROWS_WGS, True, False)


@pytest.mark.parametrize(("tp", "batch", "query_len", "expected"), [
    (1, 16, 4, WgmmaShape(1, 2, 2, True, False)),  # 256 programs: two warpgroups, one wave at 2 CTAs an SM
    (8, 64, 4, WgmmaShape(1, 2, 2, True, False)), (1, 32, 2, WgmmaShape(1, 2, 2, True, False)),
    (1, 20, 4, WgmmaShape(1, 3, 1, False, True)),  # 320 programs: two warpgroups would pass 2 CTAs an SM (registers)
    (1, 64, 4, WgmmaShape(1, 2, 1, True, False)),  # 1024 programs: past 3 CTAs an SM, as at L = 1
    (8, 256, 4, WgmmaShape(1, 3, 1, True, False)),  # 1024 programs of 8 heads: 3 stages, as at L = 1
    (8, 16, 4, WgmmaShape(4, 3, 1, True, True))])  # 64 programs: below the SMs, as at L = 1
def test_fp8_steps_of_several_rows_a_request_take_two_warpgroups_where_they_stay_one_wave(
        tp: int, batch: int, query_len: int, expected: WgmmaShape) -> None:
    """`choose_wgmma_shape`: fp8 steps of L > 1 rows a request with one to two programs an SM
    take `WGMMA_SHARED_ROWS_WGS` warpgroups of 2 stages a CTA (values in registers, the fp8
    product); L = 1 steps of the same size keep one of 3, and NVFP4 its L = 1 shape."""
    geometry = msa.MINIMAX_M3_TP[tp]
    assert choose_wgmma_shape(_fp8(batch, geometry, query_len), 132) == expected
    one_row = choose_wgmma_shape(_fp8(batch * query_len, geometry), 132)  # as many programs, L = 1
    shared_rows = expected == _SHARED_ROWS_SHAPE
    assert (one_row.wgs, one_row.stages) == (1, 3) if shared_rows else one_row == expected
    assert choose_wgmma_shape(_problem(batch, query_len, geometry), 132) == \
        choose_wgmma_shape(_problem(batch * query_len, geometry=geometry), 132)  # NVFP4: its L = 1 shape


@pytest.mark.parametrize(("batch", "split"), [(32, False), (33, True), (66, True), (67, False)])
def test_the_several_rows_band_is_one_to_two_programs_an_sm(batch: int, split: bool) -> None:
    """The band's edges (TP8 L = 4: B x 4 programs on 132 SMs: 128, 132, 264, 268), and what
    `config_on` gives there with no option asked (the shape's one split of two warpgroups, with
    values in registers and the fp8 product)."""
    problem = _fp8(batch, msa.MINIMAX_M3_TP[8], 4)
    shape = choose_wgmma_shape(problem, 132)
    assert (shape == _SHARED_ROWS_SHAPE) == split
    config = CuteBackend().config_on(problem, _hopper())
    if split:
        assert (config.num_splits, config.stages, config.wgs, config.vreg, config.kreg) == (1, 2, 2, True, False)
        assert not config.cluster and config.evict == "normal"


@pytest.mark.parametrize(("tp", "batch", "expected", "nvfp4"), [
    (1, 256, WgmmaShape(1, 2, 1, True, False), WgmmaShape(1, 2, 1, True, True)),
    (1, 128, WgmmaShape(1, 2, 1, True, False), WgmmaShape(1, 2, 1, True, True)),
    (1, 64, WgmmaShape(1, 3, 1, False, True), WgmmaShape(1, 3, 1, True, True)),
    (1, 50, WgmmaShape(1, 3, 1, False, True), WgmmaShape(1, 3, 1, True, True)),  # 200 programs: past 1.5 an SM
    (1, 49, WgmmaShape(1, 3, 1, False, True), WgmmaShape(2, 2, 1, True, True)),  # 196: NVFP4's two half walks
    (1, 34, WgmmaShape(1, 3, 1, False, True), WgmmaShape(2, 2, 1, True, True)),  # 136
    (4, 160, WgmmaShape(1, 3, 1, False, True), WgmmaShape(2, 2, 1, True, True)),
    (8, 192, WgmmaShape(1, 3, 1, False, True), WgmmaShape(2, 2, 1, True, True)),
    (4, 132, WgmmaShape(1, 3, 1, False, True), WgmmaShape(1, 3, 1, True, True)),  # one program an SM
    (8, 256, WgmmaShape(1, 3, 1, False, True), WgmmaShape(1, 3, 1, True, True)),
    (8, 1024, WgmmaShape(1, 3, 1, True, False), WgmmaShape(1, 2, 1, True, True)),  # 8-head fp8 past 3 CTAs an SM
    (1, 16, WgmmaShape(2, 2, 2, False, True), WgmmaShape(4, 3, 1, True, True)),
    (1, 8, WgmmaShape(4, 2, 2, False, True), WgmmaShape(8, 3, 1, True, True)),
    (4, 64, WgmmaShape(2, 2, 2, False, True), WgmmaShape(4, 3, 1, True, True)),
    (4, 16, WgmmaShape(8, 3, 1, True, True), WgmmaShape(8, 3, 1, True, True)),  # 16 heads below a wave: vreg
    (8, 64, WgmmaShape(4, 3, 1, True, True), WgmmaShape(4, 3, 1, True, True)),
    (8, 16, WgmmaShape(8, 3, 1, True, True), WgmmaShape(8, 3, 1, True, True)),
    (1, 1, WgmmaShape(8, 3, 1, True, True), WgmmaShape(8, 3, 1, True, True))])
def test_the_wgmma_shape_is_the_measured_one(tp: int, batch: int, expected: WgmmaShape, nvfp4: WgmmaShape) -> None:
    """fp8 and NVFP4 (keys and values always in registers; one warpgroup below the SMs) at M3's
    TP head layouts on 132 SMs."""
    assert choose_wgmma_shape(_fp8(batch, msa.MINIMAX_M3_TP[tp]), 132) == expected
    config = CuteBackend(kernel="wgmma").config_for(_fp8(batch, msa.MINIMAX_M3_TP[tp]), torch.device("cpu"))
    assert config.kernel == "wgmma"
    assert choose_wgmma_shape(_problem(batch, geometry=msa.MINIMAX_M3_TP[tp]), 132) == nvfp4
    # an fp8 query takes the fp8 product it asks for (the keys straight from shared memory), fp8 or NVFP4 cache alike
    q8 = attrs.evolve(_fp8(batch, msa.MINIMAX_M3_TP[tp]), q_dtype=torch.float8_e4m3fn)
    assert choose_wgmma_shape(q8, 132) == attrs.evolve(expected, kreg=False)
    assert not CuteBackend(kernel="wgmma").config_on(q8, _hopper()).kreg
    assert CuteBackend(kernel="wgmma", kreg=True).config_on(q8, _hopper()).kreg
    assert choose_wgmma_shape(attrs.evolve(q8, kv_layout="nvfp4"), 132) == nvfp4


@pytest.mark.parametrize(("tp", "batch", "halves"), [(1, 33, False), (1, 34, True), (1, 49, True), (1, 50, False),
                                                     (4, 160, True), (8, 192, True), (8, 199, False), (1, 64, False)])
def test_fp8_steps_of_one_to_one_and_a_half_programs_an_sm_take_two_half_walks_on_an_h200(
        tp: int, batch: int, halves: bool) -> None:
    """Past one program an SM and up to 1.5 (`WGMMA_HALF_SPLIT_PROGRAMS`), fp8 takes two splits of
    2 stages with values in registers on the devices where that measured faster (an H200), one
    split elsewhere (an H100, or a name msa does not know); the configuration follows the shape."""
    problem = _fp8(batch, msa.MINIMAX_M3_TP[tp])
    one_split = choose_wgmma_shape(problem, 132)
    assert one_split.num_splits == 1 and choose_wgmma_shape(problem, 132, device_name="NVIDIA H100 80GB HBM3") == one_split
    shape = choose_wgmma_shape(problem, 132, device_name="NVIDIA H200")
    assert shape == (WgmmaShape(2, 2, 1, True, True) if halves else one_split)
    h200 = attrs.evolve(_hopper(), device_name="NVIDIA H200")
    config = CuteBackend().config_on(problem, h200)
    assert (config.num_splits, config.stages, config.vreg) == (shape.num_splits, shape.stages, shape.vreg)
    assert CuteBackend().config_on(problem, _hopper()).num_splits == 1


def test_fused_splits_merge_in_a_cluster_where_it_measured_faster() -> None:
    """fp8 steps of 16-head CTAs merge their 2-8 fused splits as one cluster through distributed
    shared memory by default (no partials in global memory); 8-head and NVFP4 steps, programs of
    several rows, one split and more splits than a cluster holds merge from global memory;
    `cluster` asks for either."""
    cpu = torch.device("cpu")
    tp1, tp4, tp8 = msa.MINIMAX_M3, msa.MINIMAX_M3_TP[4], msa.MINIMAX_M3_TP[8]
    for problem, splits in ((_fp8(16, tp1), 2), (_fp8(16, tp4), 8), (_fp8(64, tp4), 2)):
        config = CuteBackend(kernel="wgmma").config_on(problem, _hopper())
        assert config.cluster and config.num_splits == splits and wgmma_cluster(config) == splits
        assert f"a cluster of {splits} CTAs" in (CuteBackend().strategy(problem, _hopper()) or "")
        assert launch.CuteWorkspace(problem, config, cpu).partial_out.shape[0] == 1  # no partials in global memory
        off = CuteBackend(kernel="wgmma", cluster=False).config_on(problem, _hopper())
        assert launch.CuteWorkspace(problem, config, cpu)._ml.numel() == 2  # nor counters
        assert not wgmma_cluster(off) and launch.CuteWorkspace(problem, off, cpu).partial_out.shape[0] > 1
    for problem in (_fp8(16, tp8), _problem(16, geometry=tp4), _problem(16)):
        assert not CuteBackend(kernel="wgmma").config_on(problem, _hopper()).cluster
    # four splits of two-warpgroup CTAs (32 programs) measured slower as clusters, two faster
    for problem, splits, cluster in ((_fp8(8), 4, False), (_fp8(16, msa.MINIMAX_M3_TP[2]), 4, False),
                                     (_fp8(16), 2, True)):
        config = CuteBackend(kernel="wgmma").config_on(problem, _hopper())
        assert (config.wgs, config.num_splits, config.cluster) == (2, splits, cluster)
        assert wgmma_cluster(CuteBackend(kernel="wgmma", cluster=True).config_on(problem, _hopper())) == splits
    assert not CuteBackend(kernel="wgmma", tokens=2).config_on(_fp8(16, tp1, 2), _hopper()).cluster
    asked = CuteBackend(kernel="wgmma", cluster=True).config_on(_problem(16, geometry=tp8), _hopper())
    assert wgmma_cluster(asked) == asked.num_splits == 8
    for splits in (1, 9):
        config = CuteBackend(kernel="wgmma", cluster=True, num_splits=splits).config_on(_fp8(16, tp4), _hopper())
        assert config.cluster and wgmma_cluster(config) == 0
    with pytest.raises(MSAInputError, match="cluster.*with fused=False"):
        CuteBackend(kernel="wgmma", cluster=True, fused=False).config_on(_fp8(16, tp4), _hopper())
    assert not CuteBackend(kernel="wgmma", cluster=False, fused=False).config_on(_fp8(16, tp4), _hopper()).cluster
    for name in ("cluster", "fused"):  # the mma kernel's splits are merged by the Triton merge kernel
        with pytest.raises(MSAInputError, match=f"{name}.*on the mma kernel"):
            CuteBackend(kernel="mma", **{name: True}).config_on(_problem(16), _hopper())
    mma = CuteBackend(kernel="mma", cluster=False, fused=False).config_on(_problem(16), _hopper())
    assert not mma.fused and not wgmma_cluster(attrs.evolve(mma, cluster=True, fused=True, num_splits=2))


@pytest.mark.parametrize(("option", "value", "default"), [
    ("evict", None, "normal"), ("evict", "normal", "normal"), ("evict", "first", "normal"), ("evict", "last", "normal"),
    ("refill", None, "top"), ("refill", "top", "top"), ("refill", "late", "top")])
def test_the_ring_options_asked_reach_the_wgmma_kernels_spec_and_the_mma_kernel_takes_only_their_default(
        option: str, value: str | None, default: str) -> None:
    """`CuteBackend(evict=...)` (the L2 priority of the TMA copies) and `refill=...` (when a ring
    copy starts): the wgmma kernel's config and compile-time spec carry the value asked (unless
    asked: the priority `wgmma_evict` chooses, "first" for these one-wave fp8 steps of one row a
    request, and "top"); the mma kernel, which has no ring of TMA copies, takes the default (or
    None) and refuses the others when the step is planned."""
    pytest.importorskip("cutlass", reason="the spec is the DSL kernel's")
    from msa.backends.cute.launch import spec_for

    for problem in (_fp8(16, msa.MINIMAX_M3_TP[8]), _fp8(64, msa.MINIMAX_M3_TP[1])):
        config = CuteBackend(kernel="wgmma", **{option: value}).config_on(problem, _hopper())
        spec = spec_for(problem, config, torch.bfloat16, False)
        assert getattr(config, option) == getattr(spec, option) == (value or {"evict": "first"}.get(option, default))
    if value in (None, default):
        assert getattr(CuteBackend(kernel="mma", **{option: value}).config_on(_problem(16), _hopper()), option) == default
    else:
        with pytest.raises(MSAInputError, match=rf"^{option}: expected '{default}' \(or None\) on the mma kernel"):
            CuteBackend(kernel="mma", **{option: value}).config_on(_problem(16), _hopper())


@pytest.mark.parametrize(("tp", "layout", "batch", "query_len", "expected"), [
    (1, "fp8_e4m3", 64, 1, "first"), (8, "fp8_e4m3", 256, 1, "first"), (8, "fp8_e4m3", 16, 1, "first"),
    (1, "fp8_e4m3", 16, 1, "first"), (8, "fp8_e4m3", 64, 1, "first"),
    (1, "fp8_e4m3", 128, 1, "normal"),  # 512 CTAs: one wave, but ~4 an SM
    (1, "fp8_e4m3", 256, 1, "normal"),  # 1024 CTAs: two waves
    (1, "fp8_e4m3", 64, 4, "normal"), (8, "fp8_e4m3", 64, 4, "normal"),  # rows of a request share pages
    (1, "nvfp4", 64, 1, "normal"), (8, "nvfp4", 256, 1, "normal")])
def test_the_page_copies_leave_l2_first_only_in_one_wave_fp8_steps_of_one_row_a_request(
        tp: int, layout: str, batch: int, query_len: int, expected: str) -> None:
    """`config.wgmma_evict`, the measured rule `auto`'s wgmma steps take unless `evict` is asked:
    "first" where each page is read once and every CTA is resident at once, at most 2 an SM;
    "normal" past that, where a request's rows share pages, and for NVFP4; asking overrides it."""
    problem = DecodeProblem(geometry=msa.MINIMAX_M3_TP[tp], batch_size=batch, query_len=query_len, kv_layout=layout,
                            q_dtype=torch.bfloat16, out_dtype=torch.bfloat16, device_type="cuda", num_pages=0,
                            max_blocks=0)
    assert CuteBackend().config_on(problem, _hopper()).evict == expected
    assert CuteBackend(evict="last").config_on(problem, _hopper()).evict == "last"


def test_the_traced_kernel_is_the_wgmma_one_merging_its_own_splits() -> None:
    """`launch.traced_kernel` refuses, before compiling anything, a step whose splits another
    kernel merges, or the mma kernel."""
    for config in (CuteConfig(num_splits=2, kernel="wgmma", fused=False), CuteConfig(num_splits=1)):
        with pytest.raises(MSAInputError, match="config.*merging its own splits"):
            launch.traced_kernel(_fp8(16), config)


def test_explain_says_which_kernel_and_how() -> None:
    """`msa explain`'s line for the backend: the kernel, its splits and ring, the score product."""
    text = CuteBackend().strategy(_fp8(64), _hopper()) or ""
    assert "wgmma kernel" in text and "exact product" in text and "1 split" in text and "3-stage" in text
    assert "fp8 accumulation" in (CuteBackend(kreg=False).strategy(_fp8(64), _hopper()) or "")
    assert "on the tensor cores" in (CuteBackend(tconv=True).strategy(_fp8(64), _hopper()) or "")
    assert "values in registers" in (CuteBackend().strategy(_problem(256), _hopper()) or "")
    assert "mma kernel" in (CuteBackend(kernel="mma").strategy(_problem(8), _hopper()) or "")
    assert "merged in the kernel" in (CuteBackend().strategy(_fp8(16), _hopper()) or "")
    assert "cannot run" in (CuteBackend(kernel="wgmma", stages=1).strategy(_fp8(64), _hopper()) or "")


@pytest.mark.parametrize(("layout", "tp", "batch", "chosen"), [
    ("fp8_e4m3", 1, 64, True), ("fp8_e4m3", 1, 8, True), ("fp8_e4m3", 1, 2, True), ("fp8_e4m3", 1, 1, True),
    ("fp8_e4m3", 4, 16, True), ("fp8_e4m3", 4, 1, True), ("fp8_e4m3", 2, 1, True), ("fp8_e4m3", 2, 4, True),
    ("fp8_e4m3", 8, 16, True), ("fp8_e4m3", 8, 8, False), ("nvfp4", 8, 16, True), ("nvfp4", 8, 8, False),
    ("nvfp4", 4, 16, True), ("nvfp4", 4, 8, False), ("nvfp4", 1, 4, True), ("nvfp4", 1, 2, False)])
def test_auto_takes_the_wgmma_kernel_from_16_programs_or_every_fp8_step_of_16_heads(layout: str, tp: int, batch: int,
                                                                          chosen: bool) -> None:
    problem = attrs.evolve(_problem(batch, geometry=msa.MINIMAX_M3_TP[tp]), kv_layout=layout)
    reasons = CuteBackend().extra_reasons(problem, _hopper())
    assert (not any("programs" in r for r in reasons)) == chosen
    if layout == "fp8_e4m3":
        assert any("sm_90a" in r for r in CuteBackend().extra_reasons(problem, attrs.evolve(_hopper(),
                                                                                            capability=(10, 0))))


@pytest.mark.parametrize("layout", ["fp8_e4m3", "nvfp4"])
def test_auto_takes_multi_token_steps_on_the_wgmma_kernel(layout: str) -> None:
    """Where the triton backend would deduplicate (M3 TP1 L = 4 B = 64): the wgmma kernel measured
    faster per token on both layouts (`test_the_mma_kernel_leaves_dedup_steps_to_the_triton_dedup_kernel`)."""
    problem = attrs.evolve(_problem(64, query_len=4), kv_layout=layout)
    assert not any("dedup" in r for r in CuteBackend().extra_reasons(problem, _hopper()))


@pytest.mark.parametrize(("dtype", "terms", "exact_from", "exponents"),
                         [(torch.bfloat16, 2, 2**-9, (-20, 20)), (torch.float16, 3, 2**-6, (-8, 10))])
def test_the_fp8_terms_of_a_query_hold_it_exactly(dtype: torch.dtype, terms: int, exact_from: float,
                                                  exponents: tuple[int, int]) -> None:
    """The premise of the wgmma kernel's scores (`sm90.py`), on fresh random queries of every
    magnitude: a head scaled by 2^(7 - floor(log2 max|q|)) and split into e4m3 terms (`terms` per
    dtype, each the rounded remainder of the ones before) sums back to itself exactly for every
    element from `exact_from` of the head's largest up (bf16: 2^-9, f16: 2^-6), and within 2^-17
    of the head's largest below that. (One term fewer fails.)"""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    scale = torch.exp2(torch.randint(*exponents, (512, 1), generator=gen).float())
    q = (torch.randn(512, 128, generator=gen) * scale).to(dtype).float()
    amax = q.abs().amax(1, keepdim=True)
    x = q * torch.exp2(7 - torch.floor(torch.log2(amax)))
    rest, total = x.clone(), torch.zeros_like(x)
    for _ in range(terms):
        term = rest.to(torch.float8_e4m3fn).float()
        total, rest = total + term, rest - term
    largest = x.abs().amax(1, keepdim=True)
    assert ((largest >= 128) & (largest < 256)).all()
    big = x.abs() >= exact_from * largest
    assert torch.equal(total[big], x[big])
    assert ((total - x).abs() <= 2**-17 * largest).all()


def test_the_kernel_option_is_checked() -> None:
    with pytest.raises(MSAInputError, match=r"^kernel: expected one of 'mma', 'wgmma', got 'tma'"):
        CuteBackend(kernel="tma")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_wgmma_heads_follow_the_gqa_group(tp: int) -> None:
    g = msa.MINIMAX_M3_TP[tp]
    assert wgmma_heads(g.group_size) == (8 if g.group_size <= 8 else 16)
    assert wgmma_programs(_fp8(3, g)) == 3 * g.num_kv_heads * -(-g.group_size // wgmma_heads(g.group_size))


@pytest.mark.parametrize("batch", [1, 2, 8, 33, 64, 256, 1000])
@pytest.mark.parametrize("sms", [1, 132])
def test_wgmma_splits_fill_the_slots_once_and_keep_four_tiles(batch: int, sms: int) -> None:
    problem = _fp8(batch)
    for stages, wgs in ((3, 1), (2, 1), (2, 2)):
        splits = choose_wgmma_splits(problem, sms, stages, wgs)
        g = problem.geometry
        assert 1 <= splits <= g.topk * g.page_size // 64 // (4 * wgs)
        if splits > 1:
            assert wgmma_programs(problem) * splits <= wgmma_ctas_per_sm(stages, wgs) * sms
    assert [wgmma_ctas_per_sm(st, w) for st, w in ((2, 1), (3, 1), (2, 2), (3, 2))] == [4, 3, 2, 1]
    assert wgmma_ctas_per_sm(2, 1, vreg=True) == 5  # by shared memory (its 120 registers allow 4)
    assert wgmma_ctas_per_sm(3, 1, vreg=True) == 4  # 56 KiB exactly: 4 x (56 + 1) KiB = 228 KiB


def test_measured_choices() -> None:
    """The H200 (132 SMs) choices benchmarks/bench_cute.py measured best (or within 3%)."""
    assert choose_splits(_problem(64), 132) == 1
    assert choose_splits(_problem(256), 132) == 1
    assert choose_splits(_problem(8), 132) == 8
    assert choose_min_ctas(_problem(256), 132, 1) == WIDE_MIN_CTAS  # past one wave: 4 CTAs per SM
    assert choose_min_ctas(_problem(64), 132, 1) == DEFAULT_MIN_CTAS


def test_auto_leaves_small_steps_to_triton_but_a_request_runs_them() -> None:
    backend = CuteBackend()
    small, large = _problem(1), _problem(8)
    assert programs(large) >= AUTO_MIN_PROGRAMS > programs(small)
    assert any("auto" in r for r in backend.problem_reasons(small, _hopper()))
    assert not backend.problem_reasons(small, _hopper(), requested=True)
    assert not backend.problem_reasons(large, _hopper())
    blackwell = Platform(device_type="cuda", capability=(10, 0), sm_count=148, packages=frozenset({"cutlass_dsl"}))
    assert any("Hopper" in r for r in backend.problem_reasons(large, blackwell))
    assert not backend.problem_reasons(large, blackwell, requested=True)


def test_auto_takes_eager_and_captured_steps_alike() -> None:
    """Launches pack their own arguments (no DSL host path per call), so an eager step is chosen
    as a captured one is."""
    backend = CuteBackend()
    for batch in (8, 64, 256):
        assert not backend.problem_reasons(_problem(batch, graph_capture=False), _hopper())
        assert not backend.problem_reasons(_problem(batch, graph_capture=True), _hopper())


def test_misaligned_steps_are_refused_at_selection() -> None:
    """Steps whose tensors its vector loads cannot read are refused when the backend is chosen,
    by `auto` and by name (the triton backend takes them), not when they run."""
    backend = CuteBackend()
    misaligned = attrs.evolve(_problem(64), vector_aligned=False)
    for requested in (False, True):
        assert any("aligned" in r for r in backend.problem_reasons(misaligned, _hopper(), requested=requested))
    from msa.policy import default_policy

    chosen, _ = default_policy().select(misaligned, _hopper(), "auto")
    assert chosen.name == "triton"


def test_refusals_name_what_is_missing() -> None:
    backend = CuteBackend()
    ampere = Platform(device_type="cuda", capability=(8, 0), sm_count=108, packages=frozenset({"triton"}))
    reasons = " ".join(backend.platform_reasons(ampere))
    assert "9.0" in reasons and "pip install nvidia-cutlass-dsl" in reasons
    odd = Geometry(num_q_heads=16, num_kv_heads=2, head_dim=64, page_size=24, topk=40)
    text = " ".join(backend.problem_reasons(_problem(8, geometry=odd), _hopper(), requested=True))
    assert "head" in text and "page size 24" in text and "top-k 40" in text
    bf16 = DecodeProblem(geometry=msa.MINIMAX_M3, batch_size=8, query_len=1, kv_layout="bfloat16",
                        q_dtype=torch.bfloat16, out_dtype=torch.bfloat16, device_type="cuda", num_pages=0,
                        max_blocks=0)
    assert not backend.problem_reasons(bf16, _hopper(), requested=True)  # (the wgmma kernel reads it)
    assert "sm_90a" in " ".join(backend.problem_reasons(bf16, attrs.evolve(_hopper(), capability=(10, 0)),
                                                        requested=True))


# -- the kernel ------------------------------------------------------------------------------

GPU_FUZZ = settings(max_examples=int(os.environ.get("MSA_CUTE_FUZZ_EXAMPLES", "40")), deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.gpu
@needs_kernel
@GPU_FUZZ
@given(params=step_params(max_batch=4, layouts=("nvfp4", "fp8_e4m3"), head_dim=128, groups=(1, 3, 8, 16, 20),
                          pages=(16, 32, 64), max_topk=32, max_blocks=6),
       seed=st.integers(0, 2**31 - 1), splits=st.sampled_from([None, 1, 2, 5]), stages=st.sampled_from([None, 2]),
       lse_wanted=st.booleans())
def test_cute_matches_the_float64_loop_on_poisoned_steps(params: dict[str, Any], seed: int, splits: int | None,
                                                          stages: int | None, lse_wanted: bool) -> None:
    hostile = make_hostile(params, seed)  # on the CPU: the float64 loop reads it there
    note(f"{hostile} splits={splits} stages={stages} lse={lse_wanted}")
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in hostile.kwargs.items()}
    problem, inputs = check_decode_inputs(**kw, return_lse=lse_wanted)
    q = kw["q"]
    out = torch.full(q.shape, float("nan"), dtype=problem.out_dtype, device="cuda")
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    CuteBackend(num_splits=splits, stages=stages).run_step(problem, inputs, out, lse if lse_wanted else None)
    if not lse_wanted:
        lse = msa.sparse_decode(**hostile.kwargs, backend="reference", return_lse=True)[1]
    assert_close_to_naive(hostile, out.cpu(), lse.cpu(), where=f"cute [{hostile} splits={splits}]",
                          atol=gpu_atol(hostile.kwargs))


ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_wgmma = pytest.mark.skipif(not (HAVE_DSL and ON_SM90),
                                 reason="needs nvidia-cutlass-dsl and a GPU of compute capability 9.x (sm_90a)")


def _run_wgmma_against_the_loop(hostile: Any, backend: CuteBackend, lse_wanted: bool, where: str,
                                lse_tol: float | None = None) -> CuteConfig:
    """`backend`'s wgmma kernel on `hostile`'s step (NaN-filled outputs) against the float64 loop
    (with `lse_tol`, the kernel's LSE of every row that sees something within it of the loop's);
    the configuration it ran."""
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in hostile.kwargs.items()}
    problem, inputs = check_decode_inputs(**kw, return_lse=lse_wanted)
    config = backend.config_for(problem, torch.device("cuda"))
    assert config.kernel == "wgmma"
    out = torch.full(kw["q"].shape, float("nan"), dtype=problem.out_dtype, device="cuda")
    lse = torch.full(kw["q"].shape[:2], float("nan"), device="cuda")
    backend.run_step(problem, inputs, out, lse if lse_wanted else None)
    if not lse_wanted:
        lse = msa.sparse_decode(**hostile.kwargs, backend="reference", return_lse=True)[1]
    assert_close_to_naive(hostile, out.cpu(), lse.cpu(), where=where, atol=gpu_atol(hostile.kwargs))
    if lse_tol is not None:
        ref_lse = hostile.naive()[1]
        seen = ~np.isneginf(ref_lse)
        assert np.abs(lse.cpu().double().numpy()[seen] - ref_lse[seen]).max(initial=0.0) <= lse_tol, where
    return config


@pytest.mark.gpu
@needs_wgmma
@GPU_FUZZ
@given(params=step_params(max_batch=4, layouts=("fp8_e4m3", "nvfp4", "bfloat16", "float16"), head_dim=128,
                          groups=(1, 3, 8, 16, 20), pages=(64, 128), max_topk=32, max_blocks=6),
       seed=st.integers(0, 2**31 - 1), splits=st.sampled_from([None, 1, 2, 5, 9, 17, 33]),
       stages=st.sampled_from([None, 2, 4]),
       lse_wanted=st.booleans(), lag=st.sampled_from([None, False, True]), wgs=st.sampled_from([None, 1, 2]),
       vreg=st.sampled_from([None, False, True]), kreg=st.sampled_from([None, False, True]),
       min_ctas=st.sampled_from([None, 4]), tconv=st.sampled_from([None, False, True]),
       tokens=st.sampled_from([None, 1, 2, 4, 4]), cluster=st.sampled_from([None, False, True]),
       refill=st.sampled_from([None, "late"]), evict=st.sampled_from([None, "first", "last"]))
def test_wgmma_kernel_matches_the_float64_loop_on_poisoned_steps(params: dict[str, Any], seed: int,
                                                                  splits: int | None, stages: int | None,
                                                                  lse_wanted: bool, lag: bool | None,
                                                                  wgs: int | None, vreg: bool | None,
                                                                  kreg: bool | None, min_ctas: int | None,
                                                                  tconv: bool | None, tokens: int | None,
                                                                  cluster: bool | None, refill: str | None,
                                                                  evict: str | None) -> None:
    """The TMA + WGMMA kernel on hostile fp8, NVFP4, bf16 and f16 steps: NaN in every byte the
    contract never reads (skipped pages, tokens past a row's length inside the tiles it copies
    whole, padded rows). NVFP4 always decodes its keys and values into registers (`vreg` / `kreg`
    False is refused: tested on the CPU); 16-bit caches never do (nor `tconv`, `lag` or a late
    refill: refused, tested on the CPU); `tconv` (fp8 keys converted on the tensor cores) takes the f16 product;
    `tokens` (rows of a request a program, their pages' union walked once: the few blocks a
    request has here make the tokens' selections overlap) where the step allows it; `cluster` (2-8
    fused splits merged through distributed shared memory; more, or one, merge as without); the
    ring's copies started late (`refill`) and with an L2 priority (`evict`)."""
    if params["layout"] == "nvfp4":
        vreg, kreg = (None if vreg is False else vreg), (None if kreg is False else kreg)
        tconv = None if tconv else tconv
    elif params["layout"] in ("bfloat16", "float16"):
        vreg, kreg, tconv = (None if vreg else vreg), (None if kreg else kreg), (None if tconv else tconv)
        lag, refill = (None if lag else lag), None
        stages = 2 if wgs == 2 and stages == 4 else stages  # (two rings of 4 x 32 KiB do not fit: refused)
    elif tconv:
        kreg = None
    hostile = make_hostile(params, seed)
    problem, _ = check_decode_inputs(**hostile.kwargs, return_lse=lse_wanted)
    if tokens is not None and wgmma_tokens_serve(problem, tokens) is not None:
        tokens = 1
    lag = None if tokens is not None and tokens > 1 else lag
    note(f"{hostile} splits={splits} stages={stages} lse={lse_wanted} lag={lag} wgs={wgs} vreg={vreg} kreg={kreg} "
         f"min_ctas={min_ctas} tconv={tconv} tokens={tokens} cluster={cluster} refill={refill} evict={evict}")
    backend = CuteBackend(num_splits=splits, stages=stages, kernel="wgmma", lag=lag, wgs=wgs, vreg=vreg, kreg=kreg,
                          min_ctas=min_ctas, tconv=tconv, tokens=tokens, cluster=cluster, refill=refill, evict=evict)
    _run_wgmma_against_the_loop(hostile, backend, lse_wanted, f"cute wgmma [{hostile} splits={splits}]")


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("tp", [1, 8])
def test_the_fp8_terms_product_stays_within_twice_the_exact_products_error(tp: int) -> None:
    """The fp8 product of an f16 query's three fp8 terms, smallest term first
    (`WGMMA_TERMS_LO_FIRST`), against the exact f16 product (`kreg`), both against the float64
    oracle on fresh data: Hopper's fp8 products keep ~13 bits of each k-step's running sum, and
    taking the hi term first made the error 4.4x the exact product's (H100, 1.23e-3 against
    2.8e-4, benchmarks/ab_terms_order.py); lo first it is 1.4x (3.9e-4)."""
    seed = random.randrange(2**31)
    step = make_decode_step(msa.MINIMAX_M3_TP[tp], batch_size=8, decode_query_len=1, context_len=8192,
                            kv_cache_dtype="fp8_e4m3", q_dtype=torch.float16, device="cuda", seed=seed)
    oracle, _ = step.oracle()
    problem, inputs = check_decode_inputs(**step.kwargs())
    errors = {}
    for kreg in (False, True):
        out = torch.full(step.q.shape, float("nan"), dtype=problem.out_dtype, device="cuda")
        CuteBackend(kernel="wgmma", kreg=kreg).run_step(problem, inputs, out, None)
        errors[kreg] = ((out.double() - oracle).norm() / oracle.norm()).item()
    assert errors[False] <= 2 * errors[True], f"seed {seed}: Frobenius error by kreg {errors}"


@pytest.mark.gpu
@needs_wgmma
def test_the_warp_rank_puts_distinct_keys_in_ascending_order() -> None:
    """`ptx.warp_rank_i32`, with which the wgmma kernel walks a row's entries in ascending block
    order: on 32 distinct random signed keys (the extremes among them), lane i's rank is the
    count of keys below its own, so the ranks are a permutation that sorts them."""
    from cute_probes import warp_rank_host
    from cutlass import Int64

    host = warp_rank_host()
    seed = random.randrange(2**31)
    gen = random.Random(seed)  # fresh keys each run; the seed is in the failure message
    values = gen.sample(range(-2**31 + 1, 2**31 - 1), 30) + [-2**31, 2**31 - 1]
    gen.shuffle(values)
    keys = torch.tensor(values, dtype=torch.int32, device="cuda")
    ranks = torch.full_like(keys, -1)
    host(Int64(keys.data_ptr()), Int64(ranks.data_ptr()))
    torch.cuda.synchronize()
    expected = [sorted(values).index(v) for v in values]
    assert ranks.cpu().tolist() == expected, f"seed {seed}: keys {values}"


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize(("layout", "group", "tokens", "splits"),
                         [("fp8_e4m3", 8, 4, None), ("fp8_e4m3", 8, 2, 3), ("fp8_e4m3", 16, 2, None),
                          ("nvfp4", 8, 4, 5), ("nvfp4", 16, 2, 1), ("bfloat16", 16, 2, 1), ("float16", 8, 4, None)])
def test_wgmma_programs_of_several_rows_walk_their_pages_union_exactly(layout: str, group: int, tokens: int,
                                                                       splits: int | None) -> None:
    """Programs of `tokens` rows of a request (their selections' union walked once, each token's
    columns masked to its own pages and length) on hostile M3-like steps whose rows share most of
    their pages (16 of a request's 20 blocks each) and end at different positions, NaN in every
    unread byte: against the float64 loop, with fresh data each run."""
    params = {"layout": layout, "batch": 3, "query_len": 4, "num_kv_heads": 2, "group": group, "head_dim": 128,
              "page_size": 128, "topk": 16, "max_blocks": 20, "ragged": False, "token_major": False,
              "tensor_scales": False, "table_pad": 1, "q_fp8": False}
    hostile = make_hostile(params, random.randrange(2**31))
    backend = CuteBackend(kernel="wgmma", tokens=tokens, num_splits=splits)
    config = _run_wgmma_against_the_loop(hostile, backend, True, f"cute wgmma tokens={tokens} [{hostile}]")
    assert config.tokens == tokens


@pytest.mark.gpu
@needs_wgmma
@GPU_FUZZ
@given(params=step_params(max_batch=4, layouts=("bfloat16", "float16"), head_dim=128, groups=(8, 16),
                          pages=(64, 128), max_topk=32, max_blocks=6),
       seed=st.integers(0, 2**31 - 1), q_kind=st.sampled_from(["other", "fp8"]), splits=st.sampled_from([None, 1, 3]))
def test_16_bit_caches_take_every_query_dtype_exactly(params: dict[str, Any], seed: int, q_kind: str,
                                                      splits: int | None) -> None:
    """The wgmma kernel's 16-bit products take the query in terms of the cache's type
    (`config.WIDE_Q_TERMS`): a bf16 cache with an f16 query (two bf16 terms: the query is drawn
    in f32 and rounded to f16, so its low term is not zero), an f16 cache with a bf16 query (one
    scaled f16 term) or an fp8 one, on hostile steps against the float64 loop. The scores are
    exact, so the LSE is held to 2e-4 (a dropped low term moves it by ~1e-3)."""
    params = {**params, "q_fp8": False}
    hostile = make_hostile(params, seed)
    poisoned = torch.isnan(hostile.kwargs["q"].float())  # (the rows that see nothing keep their NaN)
    dtype = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.float16, "float16": torch.bfloat16}
    fresh = torch.randn(poisoned.shape, generator=torch.Generator().manual_seed(seed))
    q = fresh.masked_fill(poisoned, float("nan")).to(dtype["fp8" if q_kind == "fp8" else params["layout"]])
    hostile = dataclasses.replace(hostile, kwargs={**hostile.kwargs, "q": q})
    note(f"{hostile} q={q.dtype} splits={splits}")
    _run_wgmma_against_the_loop(hostile, CuteBackend(kernel="wgmma", num_splits=splits), True,
                                f"cute wgmma [{hostile} q={q.dtype}]", lse_tol=2e-4)


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize(("layout", "stages", "wgs"), [("bfloat16", 2, 1), ("bfloat16", 3, 2), ("float16", 4, 1)])
def test_16_bit_rings_wrap_many_times_exactly(layout: str, stages: int, wgs: int) -> None:
    """One split walking M3-like rows whole (16 selected pages of 128 tokens: 32 tiles through a
    ring of 2-4 stages, every stage released and refilled many times, their mbarriers' phases
    past the second), one or two warpgroups, on a hostile step (rows ending inside a tile, NaN in
    every unread byte) against the float64 loop with fresh data each run."""
    params = {"layout": layout, "batch": 3, "query_len": 1, "num_kv_heads": 2, "group": 16, "head_dim": 128,
              "page_size": 128, "topk": 16, "max_blocks": 20, "ragged": False, "token_major": False,
              "tensor_scales": False, "table_pad": 1, "q_fp8": False}
    hostile = make_hostile(params, random.randrange(2**31))
    backend = CuteBackend(kernel="wgmma", num_splits=1, stages=stages, wgs=wgs)
    config = _run_wgmma_against_the_loop(hostile, backend, True, f"cute wgmma ring [{hostile}]")
    assert (config.num_splits, config.stages, config.wgs) == (1, stages, wgs)


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize(("kv_heads", "layout"), [(4, "fp8_e4m3"), (1, "fp8_e4m3"), (1, "nvfp4"), (1, "bfloat16")])
def test_the_default_cluster_shapes_merge_exactly(kv_heads: int, layout: str) -> None:
    """The shapes that merge their splits as one cluster by default (fp8, 16-head CTAs: M3 TP1
    B = 16, two splits of two warpgroups; TP4 B = 16, eight splits of one), and NVFP4 and bf16 TP4
    B = 16 asked for a cluster, on hostile M3-like steps with NaN in every unread byte, against the
    float64 loop with fresh data each run (the fuzzed test reaches these shapes only by chance)."""
    params = {"layout": layout, "batch": 16, "query_len": 1, "num_kv_heads": kv_heads, "group": 16,
              "head_dim": 128, "page_size": 128, "topk": 16, "max_blocks": 20, "ragged": False, "token_major": False,
              "tensor_scales": False, "table_pad": 1, "q_fp8": False}
    hostile = make_hostile(params, random.randrange(2**31))
    backend = CuteBackend(kernel="wgmma", cluster=True if layout in ("nvfp4", "bfloat16") else None)
    config = _run_wgmma_against_the_loop(hostile, backend, True, f"cute wgmma default cluster [{hostile}]")
    assert wgmma_cluster(config) == config.num_splits >= 2, config


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("options", [{"cluster": False}, {"cluster": True}, {"lag": True}, {"tokens": 2}])
def test_the_traced_kernel_writes_its_milestones_in_order_and_the_same_answer(options: dict[str, Any]) -> None:
    """`Sm90Spec.trace` (benchmarks/trace_cute.py): every CTA writes each milestone's clock, in
    order (the walks of `lag` and of several rows a program too), its tile count and the global
    timer at its start and end; the CTAs that merged say so (with `cluster` all of a program's
    splits, else its last); the output is the reference's. A program of one row walks its tiles
    in ascending block order (its list comes in the indexer's order): each split's first tiles
    are the split's share of that order."""
    from msa.backends.cute.sm90 import TRACE_POINTS, TRACE_TILES, TRACE_WALKED, TRACE_WORDS

    tokens = options.get("tokens", 1)
    cluster = options.get("cluster", False)
    step = make_decode_step(msa.MINIMAX_M3_TP[8], batch_size=2, decode_query_len=tokens, context_len=4096,
                            kv_cache_dtype="fp8_e4m3", device="cuda", seed=random.randrange(2**31))
    # a few unused entries among the used (-1, a negative id, ids past the visible blocks), so the
    # walk must skip them; every split keeps at least TRACE_TILES tiles
    step.topk_indices[:, :, 3] = -1
    step.topk_indices[:, :, 9] = -7
    step.topk_indices[:, :, 12] = step.block_table.shape[1] + 5
    problem, inputs = check_decode_inputs(**step.kwargs())
    plan = CuteBackend(kernel="wgmma", num_splits=4, **options).plan(problem, StepTables.for_inputs(problem, inputs))
    assert (plan.config.tokens, plan.config.lag, plan.config.cluster) == (tokens, options.get("lag", False), cluster)
    traced, ctas = launch.traced_kernel(problem, plan.config)
    programs = wgmma_programs(problem, tokens)
    assert ctas == programs * 4
    words = torch.zeros((ctas, TRACE_WORDS), dtype=torch.int64, device="cuda")
    words[:, TRACE_WALKED:] = -1  # (page 0's first tile would read 0)
    out = torch.full(step.q.shape, float("nan"), dtype=problem.out_dtype, device="cuda")
    launch.launch_cute(problem, inputs, plan.rows, out, words, plan.config, plan.workspace, {True: traced})
    want = msa.sparse_decode(**step.kwargs(), backend="reference")
    assert (out.float() - want.float()).abs().max().item() <= 2e-2
    n = len(TRACE_POINTS)
    merged = 0
    for w in words.cpu().tolist():
        clocks = [w[TRACE_POINTS.index(p)] for p in TRACE_POINTS if p != "merged"]
        assert all(clocks) and clocks == sorted(clocks), w
        assert w[n + 1] >= w[n] > 0 and w[n + 2] >= clocks[-1] and TRACE_TILES <= w[n + 3] <= 32 * tokens // 4
        if w[n + 4]:
            merged += 1
            assert w[TRACE_POINTS.index("merged")] >= clocks[-1]
    assert merged == (programs * 4 if cluster else programs)
    if tokens == 1:
        assert plan.config.wgs == 1  # (warpgroup 0 walks every tile of its split)
        walked = words[:, TRACE_WALKED:TRACE_WALKED + TRACE_TILES].cpu().view(programs, 4, TRACE_TILES)
        assert walked.tolist() == _first_tiles_in_block_order(step, plan.rows, problem.num_pages, splits=4), walked


def _first_tiles_in_block_order(step: Any, rows: Any, num_pages: int, splits: int) -> list[list[list[int]]]:
    """Each (row, split)'s first `TRACE_TILES` tiles (page x tiles a page + tile of the page; -1
    past the split's last) of a one-row program of M3 TP8 (one KV head) walking its used entries
    in ascending block order, each entry's tiles up to the row's visible length."""
    from msa.backends.cute.sm90 import TILE, TRACE_TILES

    page = step.geometry.page_size
    table = step.block_table.cpu()
    out = []
    for r, (b, pos) in enumerate(zip(rows.row_request.cpu().tolist(), rows.q_pos.cpu().tolist(), strict=True)):
        n = pos + 1
        limit = min(-(-n // page), table.shape[1])
        used = sorted(s for s in step.topk_indices[0, r].cpu().tolist()
                      if 0 <= s < limit and 0 <= int(table[b, s]) < num_pages)
        tiles = [int(table[b, s]) * (page // TILE) + t for s in used for t in range(-(-min(n - s * page, page) // TILE))]
        row = []
        for split in range(splits):
            t0, t1 = split * len(tiles) // splits, (split + 1) * len(tiles) // splits
            first = tiles[t0:min(t1, t0 + TRACE_TILES)]
            row.append(first + [-1] * (TRACE_TILES - len(first)))
        out.append(row)
    return out


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("keys", ["zero", "random"])
def test_the_nvfp4_wgmma_kernel_decodes_every_code_and_every_finite_scale_byte(keys: str) -> None:
    """NVFP4 caches of random bytes: every E2M1 code, and block scales of every finite E4M3 byte
    (negative, subnormal and 448 among them), against the reference on the same bytes. With
    zero keys every visible value of a row weighs the same, so each decoded value reaches the
    output; with random keys the scores span the whole range too. The kernel's decode
    (`ptx.nvfp4_f16_pairs`: codes at 2^-14, scales at 2^7) is exact; what differs is f32 sums
    and the f16 outputs' rounding (2^-11 of a value; Triton measured within 2e-4 of the row's
    largest value here, on the CPU)."""
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    step = make_decode_step(msa.MINIMAX_M3_TP[8], batch_size=3, context_len=4096, kv_cache_dtype="nvfp4",
                            q_dtype=torch.float16, device="cuda", seed=random.randrange(2**31))
    cache = step.kv_cache
    assert isinstance(cache, torch.Tensor)
    slots = cache.view(cache.shape[0], cache.shape[1], -1)
    codes = cache.shape[2] * msa.MINIMAX_M3_TP[8].head_dim // 2  # the slot's code bytes, then its scales
    slots[..., :codes] = torch.randint(0, 256, slots[..., :codes].shape, generator=gen, device="cuda",
                                       dtype=torch.uint8)
    finite = torch.randint(0, 254, slots[..., codes:].shape, generator=gen, device="cuda", dtype=torch.int16)
    finite = finite + (finite >= 0x7F).to(torch.int16)  # 0..0x7E, 0x80..0xFE: no NaN byte
    slots[..., codes:] = finite.to(torch.uint8)
    if keys == "zero":
        slots[:, 0::2, :codes] = 0
    problem, inputs = check_decode_inputs(**step.kwargs())
    out = torch.full(step.q.shape, float("nan"), dtype=problem.out_dtype, device="cuda")
    CuteBackend(kernel="wgmma").run_step(problem, inputs, out, None)
    ref = msa.sparse_decode(**step.kwargs(), backend="reference").float()
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    err = ((out.float() - ref) / scale).abs().amax().item()
    assert err <= 2e-3, f"{keys} keys: relative error {err:.2e}"


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("batch", [8, 64])
def test_auto_picks_cute_for_captured_nvfp4_steps_and_matches_the_reference(batch: int) -> None:
    step = make_decode_step(msa.MINIMAX_M3, batch_size=batch, context_len=4000, kv_cache_dtype="nvfp4",
                                         device="cuda", seed=batch)
    kw = step.kwargs()
    planner = msa.DecodePlanner(msa.MINIMAX_M3, kv_cache_dtype="nvfp4", device="cuda", graph_capture=True)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    assert plan.backend.name == "cute"
    out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, k_scale=kw["k_scale"],
                v_scale=kw["v_scale"])
    ref = msa.sparse_decode(**kw, backend="reference")
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=gpu_atol(kw))


@pytest.mark.parametrize(("with_lse", "ragged"), [(False, False), (True, False), (False, True)])
def test_run_launches_the_plans_compiled_kernel(with_lse: bool, ragged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run` launches the kernel compiled at plan time for its LSE choice, with the host's argument
    list (checked here on the CPU with the kernels replaced by recorders: the GPU tests run them);
    the rows of each request are L for a uniform step and 0 for a ragged one (no request of a
    row is inferred from it then)."""

    step = make_decode_step(msa.MINIMAX_M3, batch_size=8, context_len=1000, kv_cache_dtype="nvfp4", seed=1,
                            decode_query_len=2)
    kw = step.kwargs()
    if ragged:  # requests of 2, 1, 2, 1, ... rows
        kw["query_start_loc"] = torch.tensor([0, 2, 3, 5, 6, 8, 9, 11, 12], dtype=torch.int32)
        kw["q"] = kw["q"][:12]
        kw["topk_indices"] = kw["topk_indices"][:, :12]
    problem, inputs = check_decode_inputs(**kw, return_lse=with_lse)
    calls: dict[bool, list[tuple[Any, ...]]] = {False: [], True: []}
    kernels = {flag: (lambda *args, flag=flag: calls[flag].append(args)) for flag in (False, True)}
    monkeypatch.setattr(launch, "_stream", lambda device: 0x5EED)
    config = CuteBackend(num_splits=1).config_for(problem, torch.device("cpu"))
    out = torch.empty(inputs.q.shape, dtype=torch.bfloat16)
    lse = torch.empty(inputs.q.shape[:2]) if with_lse else None
    launch.launch_cute(problem, inputs, StepTables.for_inputs(problem, inputs).rows, out, lse, config,
                       launch.CuteWorkspace(problem, config, torch.device("cpu")), kernels)
    assert not calls[not with_lse] and len(calls[with_lse]) == 1
    args = calls[with_lse][0]
    assert len(args) == 42 and args[0] == inputs.q.data_ptr() and args[-1] == 0x5EED
    assert args[-3:-1] == (problem.num_rows, 0 if ragged else 2)  # the rows, then the rows of each request
    assert args[7] == out.data_ptr() and args[8] == (lse if lse is not None else out).data_ptr()


# -- the launch path, against the real DSL (compiled on the CPU, launches intercepted) ---------

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="needs nvidia-cutlass-dsl")


@pytest.fixture(scope="module")
def compiled_host() -> Any:
    """A real compiled host function (NVFP4, one split, LSE): compiling needs no GPU."""
    import cutlass.cute as cute

    from msa.backends.cute.kernel import KernelSpec, build, compile_args

    return cute.compile(build(KernelSpec("nvfp4", 128, "bf16", "bf16", True, True)), *compile_args())


def _random_values(kinds: tuple[str, ...], gen: random.Random) -> list[int | float]:
    pick = {"i64": lambda: gen.randrange(-2**63, 2**63), "i32": lambda: gen.randrange(-2**31, 2**31),
            "f32": lambda: struct.unpack("f", struct.pack("f", gen.uniform(-1e6, 1e6)))[0],
            "stream": lambda: gen.randrange(1, 2**48)}
    return [pick[k]() for k in kinds]


def _read(kind: str, address: int) -> int | float:
    return fastcall.arg_struct((kind,)).from_address(address).a0


@needs_dsl
def test_msa_packs_the_host_arguments_as_the_dsl_does(compiled_host: Any) -> None:
    """The premise of the fast launch path: the DSL's own adaptation of the kernel's 42 arguments
    (fresh random values every run) is one pointer per argument to its value in its kind's C type,
    which is what `PackedCall` builds; and the check refuses a wrong description."""
    assert fastcall.packing_matches(compiled_host, HOST_ARG_KINDS)
    values = _random_values(HOST_ARG_KINDS, random.Random())
    pointers, keep = compiled_host.generate_execution_args(*values[:-1], fastcall._cu_stream(values[-1]))
    addresses = [p.value if isinstance(p, ctypes.c_void_p) else p for p in pointers]
    assert [_read(k, a) for k, a in zip(HOST_ARG_KINDS, addresses, strict=True)] == values
    del keep
    float_as_int = ("i32" if k == "f32" else k for k in HOST_ARG_KINDS)
    assert not fastcall.packing_matches(compiled_host, tuple(float_as_int))
    assert not fastcall.packing_matches(compiled_host, HOST_ARG_KINDS[:-1])
    assert not fastcall.packing_matches(object(), HOST_ARG_KINDS)


WGMMA_VARIANTS = [("fp8", "bf16", 16, True, False, 3, False, False), ("fp8", "f16", 8, False, True, 2, False, False),
                  ("fp8", "e4m3", 16, False, False, 4, False, False), ("fp8", "bf16", 16, True, False, 3, True, False),
                  ("fp8", "f16", 8, False, True, 2, True, False), ("fp8", "e4m3", 16, False, False, 4, True, False),
                  ("fp8", "bf16", 16, True, False, 3, False, True), ("fp8", "f16", 8, False, True, 2, True, True),
                  ("nvfp4", "bf16", 16, True, False, 3, True, True), ("nvfp4", "f16", 8, False, True, 2, True, True),
                  ("nvfp4", "e4m3", 16, False, False, 4, True, True),
                  # 16-bit caches, every query kind (bf16 with f16 q: two bf16 terms)
                  ("bf16", "bf16", 16, True, False, 3, False, False), ("bf16", "f16", 8, False, True, 2, False, False),
                  ("bf16", "e4m3", 16, False, False, 2, False, False), ("f16", "f16", 16, True, False, 4, False, False),
                  ("f16", "bf16", 8, False, True, 3, False, False), ("f16", "e4m3", 16, False, True, 2, False, False)]
#: fp8 with the keys converted on the tensor cores (`tconv`; with `kreg`), values copied or in registers.
TCONV_VARIANTS = [("fp8", "bf16", 16, True, False, 3, False, True), ("fp8", "f16", 8, False, True, 2, True, True),
                  ("fp8", "e4m3", 16, True, True, 2, False, True)]
#: Programs of several rows of a request (`tokens`; `nc` their columns): (variant, tconv, tokens).
UNION_VARIANTS = [(("fp8", "bf16", 32, False, True, 3, False, True), True, 4),
                  (("fp8", "e4m3", 32, True, False, 2, True, False), False, 2),
                  (("nvfp4", "f16", 32, False, True, 3, True, True), False, 4),
                  (("nvfp4", "bf16", 16, True, False, 2, True, True), False, 2),
                  (("bf16", "bf16", 32, False, True, 2, False, False), False, 2)]
#: Fused splits merged as one cluster through distributed shared memory, and the traced kernel:
#: (variant, cluster, trace).
CLUSTER_VARIANTS = [(("fp8", "bf16", 16, False, True, 3, False, True), 2, False),
                    (("nvfp4", "f16", 8, False, True, 2, True, True), 8, False),
                    (("fp8", "e4m3", 8, False, True, 3, True, False), 5, False),
                    (("fp8", "bf16", 8, True, False, 3, True, True), 0, True),
                    (("fp8", "f16", 16, False, True, 3, False, True), 4, True),
                    (("f16", "f16", 8, False, True, 2, False, False), 3, False)]


@needs_dsl
@pytest.mark.parametrize(("kind", "q_kind", "nc", "final", "fused", "stages", "vreg", "kreg", "tconv", "tokens",
                          "cluster", "trace"),
                         [(*v, False, 1, 0, False) for v in WGMMA_VARIANTS]
                         + [(*v, True, 1, 0, False) for v in TCONV_VARIANTS]
                         + [(*v, tconv, tokens, 0, False) for v, tconv, tokens in UNION_VARIANTS]
                         + [(*v, False, 1, cluster, trace) for v, cluster, trace in CLUSTER_VARIANTS])
def test_the_wgmma_kernel_compiles_for_sm90a_and_packs_like_the_other(kind: str, q_kind: str, nc: int, final: bool,
                                                                      fused: bool, stages: int, vreg: bool,
                                                                      kreg: bool, tconv: bool, tokens: int,
                                                                      cluster: int, trace: bool, tmp_path: Path) -> None:
    """Every variant of the TMA + WGMMA kernel compiles for sm_90a on a machine without a GPU, with
    the host argument list `fastcall` packs (the GPU tests run it), and its shared memory is what
    `config.wgmma_smem_bytes` (the backend's refusal of shapes that do not fit) says. In its PTX:
    a cluster merge's two cluster barriers and one load of (m, l) and one of the row from each
    split's shared memory for each vector a thread merges; the clock and timer reads only when
    traced."""
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    wgs = 1 if final else 2
    spec = Sm90Spec(128 if final else 64, q_kind, "bf16", final, not (final or trace), nc, stages, fused, vreg=vreg,
                    wgs=wgs, kind=kind, kreg=kreg, tconv=tconv, tokens=tokens, cluster=cluster, trace=trace)
    host = build_sm90(spec)
    fn, ptx = _compile_sm90a(host, tmp_path)
    assert fastcall.packing_matches(fn, HOST_ARG_KINDS)
    assert ptx.count("barrier.cluster.arrive") == ptx.count("barrier.cluster.wait") == (2 if cluster else 0)
    merged = -(-nc * 128 // 4 // (cluster * 128)) if cluster else 0  # vectors a thread merges
    assert ptx.count("ld.shared::cluster.v2.f32") == ptx.count("ld.shared::cluster.v4.f32") == cluster * merged
    assert ("%clock64" in ptx) == ("%globaltimer" in ptx) == trace
    q_bytes = wgmma_q_bytes(kind, q_kind, kreg)
    assert host.built["storage"].__sizeof__() == wgmma_smem_bytes(kind, stages, wgs, vreg, spec.page_size, nc,
                                                                  q_bytes, tconv, tokens) <= SM90_SMEM


@needs_dsl
@pytest.mark.parametrize("q_kind", ["bf16", "f16"])
def test_the_terms_product_takes_the_smallest_term_first_by_default(q_kind: str, tmp_path: Path) -> None:
    """A wide fp8 step's kernel (the fp8 product of the query's terms) is compiled with
    `lo_first`, and the flag reaches the code: the other order compiles to other PTX with the
    same wgmma instructions (the GPU test above holds the order's error)."""
    from msa.backends.cute.sm90 import build_sm90

    q_dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[q_kind]
    problem = attrs.evolve(_fp8(256), q_dtype=q_dtype)
    config = CuteBackend().config_on(problem, _hopper())
    spec = launch.spec_for(problem, config, problem.out_dtype, False)
    assert config.kernel == "wgmma" and not spec.kreg and spec.lo_first and spec.q_kind == q_kind
    ptx = {order: _compile_sm90a(build_sm90(attrs.evolve(spec, lo_first=order)), tmp_path / str(order))[1]
           for order in (True, False)}
    assert ptx[True] != ptx[False]
    assert ptx[True].count("wgmma.mma_async") == ptx[False].count("wgmma.mma_async") > 0


@needs_dsl
@pytest.mark.parametrize(("layout", "tp", "batch"), [("bfloat16", 1, 1), ("bfloat16", 8, 64), ("float16", 1, 256)])
def test_a_16_bit_plans_kernel_is_the_wgmma_ones_and_compiles(layout: str, tp: int, batch: int,
                                                               tmp_path: Path) -> None:
    """From a 16-bit step's configuration to the kernel it launches (`launch.spec_for`): the
    wgmma kernel of the cache's kind, no register operands, its shape's stages and splits; it
    compiles for sm_90a here, in the shared memory `wgmma_smem_bytes` says."""
    from msa.backends.cute.sm90 import build_sm90

    problem = _wide(batch, layout, msa.MINIMAX_M3_TP[tp])
    config = CuteBackend().config_on(problem, _hopper())
    spec = launch.spec_for(problem, config, problem.out_dtype, with_lse=True)
    kind = {"bfloat16": "bf16", "float16": "f16"}[layout]
    assert (spec.kind, spec.vreg, spec.kreg, spec.tconv, spec.stages, spec.final) == (
        kind, False, False, False, config.stages, config.num_splits == 1)
    host = build_sm90(spec)
    _compile_sm90a(host, tmp_path)
    q_bytes = wgmma_q_bytes(kind, spec.q_kind, False)
    assert host.built["storage"].__sizeof__() == wgmma_smem_bytes(kind, spec.stages, spec.wgs, False, 128, spec.nc,
                                                                  q_bytes) <= SM90_SMEM


@needs_dsl
def test_the_nvfp4_wgmma_kernel_needs_its_values_in_registers() -> None:
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    with pytest.raises(ValueError, match="vreg"):
        build_sm90(Sm90Spec(128, "bf16", "bf16", True, False, kind="nvfp4"))


@needs_dsl
@pytest.mark.parametrize("option", [{"vreg": True}, {"kreg": True}, {"tconv": True}, {"lag": True},
                                    {"refill": "late"}])
def test_the_16_bit_wgmma_kernel_reads_its_ring_as_stored(option: dict[str, Any]) -> None:
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    with pytest.raises(ValueError, match="as it is"):
        build_sm90(Sm90Spec(128, "bf16", "bf16", True, False, kind="bf16", **option))


@needs_dsl
@pytest.mark.parametrize(("final", "fused", "cluster", "write_lse", "trace", "why"),
                         [(False, False, 2, False, False, "fused merge of 2 .. 8"),
                          (False, True, 9, False, False, "2 .. 8"),
                          (True, True, 2, False, False, "not final"),  # (one split: nothing to merge)
                          (False, True, 1, False, False, "2 .. 8"),
                          (False, True, 0, True, True, "where the LSE would go")])
def test_the_wgmma_kernel_refuses_clusters_it_cannot_merge_and_a_trace_beside_the_lse(
        final: bool, fused: bool, cluster: int, write_lse: bool, trace: bool, why: str) -> None:
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    with pytest.raises(ValueError, match=why):
        build_sm90(Sm90Spec(128, "bf16", "bf16", final, write_lse, fused=fused, cluster=cluster, trace=trace))


@needs_dsl
@pytest.mark.parametrize(("kind", "evict"), [("fp8", "first"), ("nvfp4", "last"), ("fp8", "normal")])
def test_the_wgmma_kernels_page_copies_take_the_l2_priority_asked(kind: str, evict: str, tmp_path: Path) -> None:
    """`Sm90Spec.evict`: every TMA copy of the tiles carries the L2 cache policy of the priority
    asked (made once, by `createpolicy`); without one, the DSL's own (a zero policy word, as
    before); an unknown priority is refused."""
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    spec = Sm90Spec(128, "bf16", "bf16", True, False, 16, 2, vreg=kind == "nvfp4", kind=kind, kreg=True, evict=evict)
    _, ptx = _compile_sm90a(build_sm90(spec), tmp_path)
    policies = re.findall(r"cp\.async\.bulk\.tensor\S*L2::cache_hint [^;]*, (%rd\d+);", ptx)
    assert policies and len(policies) == ptx.count("cp.async.bulk.tensor")
    assert len(policies) % (4 if kind == "nvfp4" else 2) == 0
    made = re.findall(r"createpolicy\.fractional\.L2::evict_(\w+)\.b64 (%rd\d+), 1\.0;", ptx)
    if evict == "normal":
        assert not made and all(re.search(rf"mov\.b64\s+{r}, 0;", ptx) for r in policies), policies
    else:
        assert made == [(evict, made[0][1])] and set(policies) == {made[0][1]}, (made, policies)
    with pytest.raises(ValueError, match="L2 eviction priority"):
        build_sm90(attrs.evolve(spec, evict="sometimes"))


@needs_dsl
@pytest.mark.parametrize(("kind", "stages", "vreg"), [("fp8", 3, False), ("fp8", 2, True), ("nvfp4", 2, True)])
def test_a_late_refill_starts_the_ring_copy_after_the_tiles_products(kind: str, stages: int, vreg: bool,
                                                                      tmp_path: Path) -> None:
    """`Sm90Spec.refill`: with "late" the walk's copy is issued between the tile's products' commit
    and the wait for them, in the kernel's code; with "top" nothing is (it comes before the tile's
    copy wait); the prologue's copies come first either way; an unknown form is refused."""
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    spec = Sm90Spec(128, "bf16", "bf16", True, False, 16, stages, vreg=vreg, kind=kind, kreg=True)
    order = {}
    for refill in ("top", "late"):
        (tmp_path / refill).mkdir()
        _, ptx = _compile_sm90a(build_sm90(attrs.evolve(spec, refill=refill)), tmp_path / refill)
        copies = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor", ptx)]
        commit = ptx.index("wgmma.commit_group")  # the first tile's products (the keys are in registers)
        wait = ptx.index("wgmma.wait_group", commit)
        assert copies and copies[0] < ptx.index("wgmma.mma_async")  # the prologue's
        order[refill] = [commit < c < wait for c in copies].count(True)
    assert order == {"top": 0, "late": 4 if kind == "nvfp4" else 2}, order  # (copies a tile)
    with pytest.raises(ValueError, match="refill 'early'"):
        build_sm90(attrs.evolve(spec, refill="early"))


def _shr_s32(a: int, b: int) -> int:
    return (a - ((a >> 31) << 32)) >> b


#: The integer instructions of a probe kernel's address arithmetic (`_replay_ptx_stores`).
_INT_OPS = {"shr.u32": operator.rshift, "shr.s32": _shr_s32, "shl.b32": operator.lshift, "and.b32": operator.and_,
            "or.b32": operator.or_, "xor.b32": operator.xor, "add.s32": operator.add, "sub.s32": operator.sub}
#: The lines of such a kernel that do nothing the replay must follow (declarations, braces, the
#: inline-asm markers, the return).
_PTX_INERT = re.compile(r"\.reg \.b32\s+%r<\d+>;|\{|\}|// (begin|end) inline asm|ret;|")
_PTX_STSM = re.compile(r"\{mov\.b32 %r\d+, 0; stmatrix\.sync\.aligned\.m8n8\.(x2|x4)\.trans\.shared\.b16 "
                       r"\[(%r\d+)\], \{(%r\d+(?:, %r\d+)*)\};\}")
_PTX_INSTRUCTION = re.compile(r"([a-z][a-z0-9.]*)\s+(%r\d+),\s*([^;@{}]*);")


def _weights_probe_ptx(nc: int, wgs: int, kreg: bool, dump: Path) -> str:
    """The PTX of `cute_probes.weights_store_host(nc, wgs, kreg)`, compiled for sm_90a here."""
    from cute_probes import weights_store_host
    from cutlass import Int32

    return _compile_sm90a(weights_store_host(nc, wgs, kreg), dump, (Int32(0),))[1]


def _replay_ptx_stores(ptx: str, threads: int) -> dict[int, list[tuple[str, int, list[tuple[int, int]]]]]:
    """Each thread's `stmatrix` stores in a probe kernel's PTX (`cute_probes.weights_store_host`),
    the threads replayed in lockstep, instruction by instruction: (.x2 / .x4, row address, each
    word's (low, high) weight index, weight e having been stored as the f32 e + 1). Every line of
    the kernel must be one the replay knows, unguarded: a guard, a branch, a label or any other
    store fails the test, as does a constant that is not a weight it stored."""
    body = ptx[ptx.index(".entry"):]
    reg: list[dict[str, Any]] = [{} for _ in range(threads)]
    stores: dict[int, list[tuple[str, int, list[tuple[int, int]]]]] = {t: [] for t in range(threads)}

    def operand(t: int, x: str) -> Any:
        return reg[t][x] if x.startswith("%") else int(x, 0)

    for line in (raw.strip() for raw in body[body.index("{"):].splitlines()):
        if _PTX_INERT.fullmatch(line):
            continue
        made = _PTX_STSM.fullmatch(line)
        if made:
            for t in range(threads):
                stores[t].append((made.group(1), reg[t][made.group(2)], [reg[t][r] for r in made.group(3).split(", ")]))
            continue
        ins = _PTX_INSTRUCTION.fullmatch(line)
        assert ins, f"the replay does not know {line!r}"
        op, dst, args = ins.group(1), ins.group(2), [a.strip() for a in ins.group(3).split(",")]
        values: list[Any] = []
        for t in range(threads):
            if op == "ld.param.b32":
                values.append(0)  # the tile's base
            elif op == "mov.u32" and args == ["%tid.x"]:
                values.append(t)
            elif op == "mov.b32" and re.fullmatch(r"0f[0-9A-F]{8}", args[0]):
                weight = struct.unpack(">f", bytes.fromhex(args[0][2:]))[0]
                assert weight.is_integer() and weight >= 1, f"{weight} is not a weight the probe stores"
                values.append(int(weight) - 1)
            elif op == "cvt.rn.f16x2.f32":  # the first source goes to the high half
                values.append((reg[t][args[1]], reg[t][args[0]]))
            elif op == "shfl.sync.idx.b32" and args[2:] == ["31", "-1"]:  # from the lane given, of this warp
                values.append(reg[32 * (t // 32) + operand(t, args[1]) % 32][args[0]])
            elif op in _INT_OPS:
                values.append(_INT_OPS[op](operand(t, args[0]) & 0xFFFFFFFF, operand(t, args[1]) & 0xFFFFFFFF)
                              & 0xFFFFFFFF)
            else:
                raise AssertionError(f"the replay does not know {line!r}")
        for t in range(threads):
            reg[t][dst] = values[t]
    return stores


@needs_dsl
@pytest.mark.parametrize("injected", ["st.shared.b16 [%r2], %rs1;", "@%p1 add.s32 %r2, %r2, 16;", "bra.uni $L__BB0_1;",
                                      "mov.b32 %r3, 0f00000000;"])
def test_the_weights_replay_refuses_what_it_cannot_follow(injected: str, tmp_path: Path) -> None:
    """`_replay_ptx_stores` fails on any line it does not model (another store, a guarded
    instruction, a branch) and on a constant that is not a weight the probe stores, so a probe
    kernel doing more than it follows cannot pass the weights test."""
    ptx = _weights_probe_ptx(8, 1, True, tmp_path)
    assert _replay_ptx_stores(ptx, 128)[0]  # as compiled: it follows every line
    at = ptx.index("ret;")
    with pytest.raises(AssertionError):
        _replay_ptx_stores(ptx[:at] + injected + "\n\t" + ptx[at:], 128)


@needs_dsl
@pytest.mark.parametrize(("nc", "wgs", "kreg"), [(8, 1, True), (16, 1, True), (16, 2, True), (32, 1, True),
                                                 (64, 2, True), (16, 1, False), (8, 2, False)])
def test_the_weights_stmatrix_puts_each_weight_where_the_value_product_reads_it(nc: int, wgs: int, kreg: bool,
                                                                               tmp_path: Path) -> None:
    """`sm90.store_weights`: a probe kernel that stores a tile's weights as the wgmma kernel does
    (its `store_weights` at its `weights_row_at`, in the order of its `score_mma` fragment; weight
    e of each thread e + 1) is compiled for sm_90a and its PTX replayed thread by thread, with
    `stmatrix .trans` as PTX defines it (lanes 8 m .. 8 m + 7 give matrix m's row addresses; row j
    gets the matrix's column j: element (r, j) from lane 4 r + j // 2, half j % 2, at byte 2 r).
    Every (token, head) of each warpgroup's tile must land exactly once at its byte in
    `weights_layout` (its offsets, with the 128-byte swizzle applied to the byte address, as the
    DSL's stores through the tile and the product's descriptor do), the token and head being
    those of the weight's place in the DSL's own accumulator fragment."""
    import cutlass.cute as cute

    from msa.backends.cute.sm90 import TILE, score_mma, weights_layout

    frag: dict[int, list[tuple[int, int]]] = {}
    offset: dict[int, tuple[int, int, int]] = {}

    def collect() -> None:  # (a helper's loops are plain Python while tracing; static coordinates only)
        mma = score_mma(kreg, nc)
        for tid in range(128):
            part = mma.get_slice(tid).partition_C(cute.make_identity_tensor((TILE, nc)))
            frag[tid] = [(int(part[e][0]), int(part[e][1])) for e in range(cute.size(part))]
        outer = weights_layout(nc, wgs).outer
        for wg in range(wgs):
            for h in range(nc):
                for t in range(TILE):
                    byte = 2 * int(outer(((h % 8, h // 8), (t, 0), (0, wg))))
                    offset[byte ^ (((byte >> 7) & 7) << 4)] = (wg, t, h)  # the 128-byte swizzle

    @cute.jit
    def trace() -> None:
        collect()

    cute.compile(trace, options=f"--gpu-arch sm_90a --dump-dir {tmp_path}")
    stores = _replay_ptx_stores(_weights_probe_ptx(nc, wgs, kreg, tmp_path), 128 * wgs)
    assert len(frag[0]) == nc // 2 and len(offset) == wgs * nc * TILE
    assert {len(s) for s in stores.values()} == {max(1, nc // 16)}
    written: dict[int, tuple[int, int, int]] = {}
    for wg in range(wgs):
        for w in range(4):
            warp = [stores[128 * wg + 32 * w + lane] for lane in range(32)]
            for k, (kind, _, words) in enumerate(warp[0]):
                assert kind == ("x2" if nc == 8 else "x4") and len(words) == int(kind[1])
                for m in range(len(words)):
                    for j in range(8):
                        row = warp[8 * m + j][k][1]
                        for r in range(8):
                            lane = 4 * r + j // 2
                            token, head = frag[32 * w + lane][warp[lane][k][2][m][j % 2]]
                            assert row + 2 * r not in written
                            written[row + 2 * r] = (wg, token, head)
    assert written == offset


@needs_dsl
@pytest.mark.parametrize("words", [1, 3, 8])
def test_stmatrix_takes_two_or_four_matrices(words: int) -> None:
    """`ptx.stsm_t` writes `.x2` or `.x4`; any other count is refused before any PTX is written."""
    from msa.backends.cute import ptx

    with pytest.raises(ValueError, match=f"stmatrix stores 2 or 4 matrices, not {words}"):
        ptx.stsm_t(None, [None] * words)


@needs_dsl
@pytest.mark.parametrize("lane", [32, -1, True])
def test_a_shuffle_from_a_lane_outside_the_warp_is_refused(lane: object) -> None:
    """`ptx.shfl_idx_i32` takes a compile-time lane 0..31 (or a run-time value); anything else
    is refused before any PTX is written."""
    from msa.backends.cute import ptx

    with pytest.raises(ValueError, match="shuffle source lane"):
        ptx.shfl_idx_i32(None, lane)


@needs_dsl
def test_ptx_same_tells_a_changed_kernel_from_an_unchanged_one(tmp_path: Path) -> None:
    """benchmarks/ptx_same.py: against HEAD (where src/ has no uncommitted change, as in CI) the
    variants drawn compile alike and it exits 0; against a src tree whose kernel differs in one
    constant (`lag`'s limit) exactly the variant that uses it differs, and it exits 1; a src
    folder without `msa` is refused (this environment's own `msa` must not stand in for it)."""
    import json
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    tool = [sys.executable, str(root / "benchmarks" / "ptx_same.py")]
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True, cwd=root)
    if dirty.returncode == 0 and not dirty.stdout.strip():
        run = subprocess.run([*tool, "--against", "HEAD", "--sample", "2", "--seed", str(random.randrange(2**31))],
                             capture_output=True, text=True, cwd=root)
        assert run.returncode == 0 and "2 of 2 wgmma kernel variants compile to the same PTX" in run.stdout, run
    changed = tmp_path / "src"
    shutil.copytree(root / "src", changed)
    sm90 = changed / "msa" / "backends" / "cute" / "sm90.py"
    text = sm90.read_text()
    assert "_LAG_LIMIT = 15.0" in text
    sm90.write_text(text.replace("_LAG_LIMIT = 15.0", "_LAG_LIMIT = 14.0"))
    base = dict(page_size=128, q_kind="bf16", out_kind="bf16", final=True, write_lse=False, nc=16, stages=3,
                kind="fp8", kreg=True)
    specs = json.dumps([{**base, "lag": True}, base])
    run = subprocess.run([*tool, "--against-src", str(changed), "--specs", specs], capture_output=True, text=True)
    lines = run.stdout.splitlines()
    assert run.returncode == 1 and len(lines) == 2 and lines[0].startswith("differs:") and '"lag": true' in lines[0]
    assert lines[1].startswith("1 of 2 wgmma kernel variants compile to the same PTX") and "1 differ" in lines[1]
    empty = tmp_path / "empty"
    empty.mkdir()
    run = subprocess.run([*tool, "--against-src", str(empty), "--specs", json.dumps([base])], capture_output=True,
                         text=True)
    assert run.returncode != 0 and "not from" in run.stderr, run


@needs_dsl
@pytest.mark.parametrize("packed", [True, False])
def test_packed_call_launches_through_the_dsls_executor(compiled_host: Any, packed: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`PackedCall` hands the executor of its device one pointer per argument to the caller's
    values (packed), or calls that executor with the values and a DSL stream (not packed: the
    DSL adapts them); either way the executor is made once per device, for that device. The
    compiled launch itself is intercepted (no GPU here)."""
    seen: list[Any] = []
    devices: list[int] = []

    class Executor:
        def run_compiled_program(self, pointers: list[int]) -> None:
            seen.append([_read(k, a) for k, a in zip(HOST_ARG_KINDS, pointers, strict=True)])

        def __call__(self, *args: Any) -> None:
            seen.append(list(args))

    def to(device: int) -> Executor:
        devices.append(device)
        return Executor()

    monkeypatch.setattr(compiled_host, "to", to)
    call = fastcall.PackedCall(compiled_host, HOST_ARG_KINDS, packed)
    values = _random_values(HOST_ARG_KINDS, random.Random())
    for _ in range(2):
        call.launcher(3)(*values)
    assert call.launcher(3) is call.launcher(3)
    call.launcher(5)
    assert devices == [3, 5] and len(seen) == 2
    if packed:
        assert seen == [values, values]
    else:
        assert seen[0][:-1] == values[:-1] and int(seen[0][-1]) == values[-1]


@pytest.mark.gpu
@needs_kernel
def test_plans_launch_through_the_packed_path_and_match() -> None:
    """On the installed DSL every compiled kernel packs its own arguments (the DSL's adaptation
    matched at compile time), and a plan launched that way matches the reference, twice."""

    backend = CuteBackend()
    for seed in (2, 3):
        step = make_decode_step(msa.MINIMAX_M3, batch_size=8, context_len=3000, kv_cache_dtype="nvfp4", device="cuda",
                                seed=seed)
        kw = step.kwargs()
        problem, inputs = check_decode_inputs(**kw)
        plan = backend.plan(problem, StepTables.for_inputs(problem, inputs))
        assert launch._compiled and all(call.packed for call in launch._compiled.values())
        out = torch.full(kw["q"].shape, float("nan"), dtype=problem.out_dtype, device="cuda")
        backend.run(plan, inputs, out, None)
        ref = msa.sparse_decode(**kw, backend="reference")
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=gpu_atol(kw))


def test_the_mma_kernel_leaves_dedup_steps_to_the_triton_dedup_kernel() -> None:
    """NVFP4 at L = 4 where the triton backend would run its dedup kernel (M3 TP1 from B = 33 on 132
    SMs): the wgmma kernel, a pass per token, measured faster with and without shared pages (H100,
    80% overlap: 127.4 / 470.2 us at B = 64 / 256 against 158.3 / 551.7; none: 136.0 / 489.0
    against 272.1 / 1047.4). The mma kernel leaves those steps to the dedup kernel."""
    dedup_step = _problem(64, query_len=4)
    mma = CuteBackend(kernel="mma")
    assert any("dedup" in r for r in mma.problem_reasons(dedup_step, _hopper()))
    assert not mma.problem_reasons(dedup_step, _hopper(), requested=True)
    assert not mma.problem_reasons(_problem(16, query_len=4), _hopper())  # 64 programs < 132 SMs
    assert not mma.problem_reasons(_problem(64, query_len=2), _hopper())  # L = 2: per token


@pytest.mark.parametrize("env, refused", [("0", False), ("1", True)])
def test_auto_follows_msa_triton_dedup(env: str, refused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the mma kernel, `MSA_TRITON_DEDUP=0` (per-token everywhere) leaves those steps to this
    faster per-token kernel; `=1` leaves every multi-token step Triton can dedup to Triton. The
    wgmma kernel takes them either way."""
    monkeypatch.setenv("MSA_TRITON_DEDUP", env)
    for batch in (16, 64):
        reasons = CuteBackend(kernel="mma").problem_reasons(_problem(batch, query_len=4), _hopper())
        assert any("dedup" in r for r in reasons) == refused
        assert not CuteBackend().problem_reasons(_problem(batch, query_len=4), _hopper())


def test_auto_keeps_eager_steps_from_an_unverified_dsl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed launch was verified on the listed DSL versions; with another one a launch may
    take the DSL's slow path, so `auto` takes only steps that will be captured in graphs."""
    import msa.backends.cute as cute_module

    monkeypatch.setattr(cute_module, "dsl_version", lambda: "4.8.9")
    backend = CuteBackend()
    assert any("4.8.9" in r for r in backend.problem_reasons(_problem(64, graph_capture=False), _hopper()))
    assert not backend.problem_reasons(_problem(64, graph_capture=True), _hopper())
    assert not backend.problem_reasons(_problem(64, graph_capture=False), _hopper(), requested=True)
    monkeypatch.setattr(cute_module, "dsl_version", lambda: sorted(VERIFIED_DSL_VERSIONS)[0])
    assert not backend.problem_reasons(_problem(64, graph_capture=False), _hopper())


@needs_dsl
def test_wgmma_registers_reports_the_main_loop_and_serialised_products() -> None:
    """benchmarks/wgmma_registers.py: the main loop it finds is the tile's (one product's 8 k-steps
    of scores and 8 of values: 16 wgmma instructions for 16 heads, among a few hundred others),
    and it counts ptxas's serialisation notes where a launch bound of 3 two-warpgroup CTAs leaves
    the products no registers (none without it)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "wgmma_registers.py"), "--spec",
                          '{"wgs":2,"stages":2}', "--min-ctas", "0,3", "--mix"], capture_output=True, text=True,
                         cwd=root, env={**os.environ, "PYTHONPATH": f"{root / 'src'}:{root / 'benchmarks'}"}, check=True)
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith("{")]
    mixes = [line for line in run.stdout.splitlines() if line.startswith("    ")]
    assert [int(r[1]) for r in rows] == [0, 3] and len(mixes) == 2, run.stdout
    (_, _, regs0, _, _, serial0, loop0), (_, _, regs3, _, _, serial3, _) = rows
    assert int(serial0) == 0 and int(serial3) >= 1 and int(regs3) <= 85 < int(regs0), run.stdout
    assert "HGMMA 16" in mixes[0] and 250 < int(loop0) < 800, run.stdout


@pytest.mark.parametrize(("option", "refused", "taken"), [
    ("tokens", 4, 1), ("wgs", 2, 1), ("lag", True, False), ("tconv", True, False), ("vreg", False, True),
    ("kreg", False, True)])
def test_the_mma_kernel_refuses_the_wgmma_kernels_options_instead_of_dropping_them(option: str, refused: Any,
                                                                                     taken: Any) -> None:
    """A step the mma kernel takes (pages of 32 tokens: not the wgmma kernel's) refuses, by name, an
    option only the wgmma kernel reads (it was silently dropped: `kreg=False` asked for the fp8
    product and got the f16 one, `tokens=4` walked a row a program), and takes the value that is
    what the mma kernel does; the wgmma kernel refuses the mma kernel's `qk_chains`."""
    small_pages = Geometry(num_q_heads=16, num_kv_heads=2, head_dim=128, page_size=32, topk=8)
    problem = _problem(64, geometry=small_pages)
    with pytest.raises(MSAInputError, match=rf"^{option}: expected {taken!r} \(or None\) on the mma kernel"):
        CuteBackend(**{option: refused}).config_on(problem, _hopper())
    assert CuteBackend(**{option: taken}).config_on(problem, _hopper()).kernel == "mma"
    with pytest.raises(MSAInputError, match=r"^qk_chains: expected 1 \(or None\) on the wgmma kernel"):
        CuteBackend(qk_chains=4).config_on(_problem(64), _hopper())
    assert CuteBackend(qk_chains=4).config_on(problem, _hopper()).qk_chains == 4
