"""The Triton kernels' E4M3 decode by bits (`LaunchConfig.soft_e4m3`), for GPUs below compute
capability 8.9, where Triton has no `fp8e4nv` type: fp8 caches and queries are passed as their
bytes, NVFP4's block scales and codes decoded the same way. It must give the hardware path's
values exactly, and the configuration must pick it from the capability."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from cases import Case, build, gpu_atol
from test_sass import _kernel_sass, _spills, compiler_env
from test_triton import DEVICE, assert_matches_reference, run_triton

import msa
from msa.backends.triton import TritonBackend
from msa.backends.triton.config import choose_config
from msa.layouts import get_layout
from msa.layouts.kernels import e4m3_decode_bits, e4m3_encode_bits
from msa.platform import Platform, e4m3_in_hardware
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")

pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs CUDA or TRITON_INTERPRET=1")
#: where the kernels run: this machine's default device, and marked `gpu` for the GPU gate
WHERE = ["here", pytest.param("gpu", marks=pytest.mark.gpu)]


@triton.jit
def _decode_probe(src_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, e4m3_decode_bits(tl.load(src_ptr + i)))


@pytest.mark.parametrize("where", WHERE)
def test_the_bit_decode_gives_every_e4m3_byte_its_value(where: str) -> None:
    """All 256 bytes: zeros, subnormals, normals up to 448, both NaNs, against torch's E4M3."""
    src = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    out = torch.full((256,), 7.0, dtype=torch.float16, device=DEVICE)
    _decode_probe[(1,)](src, out, N=256)
    want = src.view(torch.float8_e4m3fn).float().cpu()
    got = out.float().cpu()
    nan = torch.isnan(want)
    assert nan.sum() == 2 and torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))  # -0 stays -0


@pytest.mark.parametrize("layout", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("splits, dedup", [(1, False), (3, False), (2, True)])
@pytest.mark.parametrize("where", WHERE)
def test_the_bit_decode_matches_the_hardware_path(layout: str, q_dtype: torch.dtype, splits: int, dedup: bool,
                                                  where: str, gen: torch.Generator) -> None:
    """Both paths on the same fresh step (partly visible pages, -1 entries, split and fused, per
    token and deduplicated): the same bits, and the reference's answer."""
    built = build(Case(layout=layout, batch=3, query_len=3, q_dtype=q_dtype, num_q_heads=8, num_kv_heads=2,
                       topk=3, max_blocks=5, tensor_scales=True), gen)
    kw = built.kwargs
    kw["topk_indices"][0, 1, :1] = -1
    bits = run_triton(kw, TritonBackend(num_splits=splits, dedup=dedup, soft_e4m3=True), DEVICE)
    hardware = run_triton(kw, TritonBackend(num_splits=splits, dedup=dedup, soft_e4m3=False), DEVICE)
    assert torch.equal(bits[0], hardware[0]) and torch.equal(bits[1], hardware[1])
    rtol, atol = (2**-7, 2e-4) if DEVICE == "cpu" else (2**-6, gpu_atol(kw))
    assert_matches_reference(kw, *bits, rtol=rtol, atol=atol)


def test_the_configuration_takes_the_bit_decode_below_sm89() -> None:
    m3 = msa.MINIMAX_M3
    fp8, nvfp4 = get_layout("fp8_e4m3"), get_layout("nvfp4")
    assert not e4m3_in_hardware((8, 0)) and not e4m3_in_hardware((8, 6))
    assert e4m3_in_hardware((8, 9)) and e4m3_in_hardware((9, 0)) and e4m3_in_hardware(None)
    for capability, soft in (((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False), (None, False)):
        config = choose_config(m3, 64, 108, layout=nvfp4, capability=capability)
        assert config.soft_e4m3 is soft and config.decode_asm is not soft, capability
    assert not choose_config(m3, 64, 108, layout=fp8, capability=(8, 0), soft_e4m3=False).soft_e4m3
    # NVFP4's 64-row dedup program takes 64-token tiles on mma.sync GPUs (1872 bytes of stack at
    # 128 on sm_80), whole pages on Hopper
    wide = dict(layout=nvfp4, batch_size=256, query_len=4)
    assert choose_config(m3, 1024, 108, capability=(8, 0), **wide).block_n == 64
    assert choose_config(m3, 1024, 132, capability=(9, 0), **wide).block_n == 128


def test_the_backend_picks_it_from_the_gpu_and_says_so() -> None:
    step = make_decode_step(msa.MINIMAX_M3, batch_size=8, context_len=512, kv_cache_dtype="fp8_e4m3")
    problem, _ = check_decode_inputs(**step.kwargs())
    backend = TritonBackend()
    ampere, hopper = Platform.cuda((8, 0), sm_count=108), Platform.cuda((9, 0))
    assert "E4M3 decoded by bits" in (backend.strategy(problem, ampere) or "")
    assert "E4M3" not in (backend.strategy(problem, hopper) or "")
    assert not backend.not_supported_reasons(problem, ampere)
    forced = TritonBackend(soft_e4m3=False)  # asked for the hardware decode where there is none: refused, says why
    assert any("soft_e4m3=False" in r and "None or True" in r for r in forced.not_supported_reasons(problem, ampere))
    assert not forced.not_supported_reasons(problem, hopper)


@triton.jit
def _encode_probe(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, e4m3_encode_bits(tl.load(src_ptr + i, mask=i < n, other=0.0)), mask=i < n)


@pytest.mark.parametrize("where", WHERE)
def test_the_bit_encode_rounds_as_torch_does(where: str, gen: torch.Generator) -> None:
    """float32 -> E4M3 by bits against torch's conversion: every E4M3 value, the midpoints between
    neighbours (ties to even), their float32 neighbours, random magnitudes from 2^-12 to 479, zeros,
    past 448 and Inf (saturated at 448, as the hardware's `satfinite`) and NaN (S.1111.111).
    torch's own conversion past 448 changed between releases (2.11, the GPU machine's: NaN from
    464 on, Inf included; 2.13: 448), so the oracle is torch's conversion of the input clamped to
    +-448 (NaN kept) — what the writers store, as they clamp first — and saturation is asserted
    on its own."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = values[values.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    near = torch.cat([mids.nextafter(mids + 1), mids.nextafter(mids - 1)])
    sign = torch.randint(0, 2, (20000,), generator=gen) * 2 - 1
    rand = torch.exp2(torch.rand(20000, generator=gen) * 20.9 - 12) * sign
    special = torch.tensor([0.0, -0.0, 480.0, -500.0, float("inf"), float("-inf"), float("nan"), 2.0**-10, 2.0**-9])
    x = torch.cat([finite, -finite, mids, -mids, near, -near, rand, special]).float().to(DEVICE)
    out = torch.full(x.shape, 0x55, dtype=torch.uint8, device=DEVICE)
    _encode_probe[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = x.cpu().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)  # (torch's conversion, CPU)
    bad = (out.cpu() != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), int(out[i]), int(want[i])) for i in bad[:8]]
    past = x.abs() > 448  # (Inf included; NaN is not)
    assert past.sum() >= 4 and bool((out[past] & 0x7F == 0x7E).all()), out[past]  # +-448, whatever torch does


@pytest.mark.parametrize("layout", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("where", WHERE)
def test_the_writers_encode_by_bits_below_sm89(layout: str, where: str, monkeypatch: pytest.MonkeyPatch,
                                               gen: torch.Generator) -> None:
    """On a GPU without E4M3 in hardware the Triton writers encode by bits (no host
    synchronisation, capturable): the torch writer's bytes, byte for byte, NaN, Inf and skipped
    slots included."""
    import msa.layouts.base as base

    monkeypatch.setattr(base, "detect", lambda device: Platform.cuda((8, 0), sm_count=108))
    assert base.e4m3_by_bits(torch.device(DEVICE))
    lay = get_layout(layout)
    key = torch.randn(9, 2, 64, generator=gen).to(torch.bfloat16) * 40
    value = torch.randn(9, 2, 64, generator=gen).to(torch.bfloat16) * 0.01
    key[1, 0, 3], key[2, 1, 5], value[3, 0, 7] = float("nan"), float("inf"), -float("inf")
    slots = torch.tensor([0, 5, 17, -1, 30, 31, 2, 400, 11])
    caches = []
    for kernel in (True, False):
        cache = lay.allocate(num_pages=2, num_kv_heads=2, page_size=16, head_dim=64, device=DEVICE)
        scales = dict(k_scale=0.5, v_scale=0.25) if layout == "fp8_e4m3" else {}
        lay.write(cache, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), kernel=kernel, **scales)
        caches.append(cache.view(torch.uint8).cpu())
    assert torch.equal(caches[0], caches[1])


def _sm80_spills(*args: str) -> dict[str, int]:
    return _spills(_kernel_sass("--capability", "8.0", *args))


@pytest.mark.parametrize("q_dtype", ["bf16", "fp8"])
def test_every_layout_compiles_for_sm80(q_dtype: str) -> None:
    """The default launches of M3 TP1 (per token at L = 1 B = 64, the dedup program at L = 4, B = 256
    with a bf16 query and B = 16 with an fp8 one) compile for an A100 (sm_80) with each query
    dtype: before the bit decode, the fp8 and NVFP4 ones and any fp8 query failed (`type fp8e4nv
    not supported in this architecture`). Stack within 264 bytes (the NVFP4 dedup program's, at
    64-token tiles; not timed: no such GPU here)."""
    layouts = "fp8_e4m3,nvfp4" + (",bfloat16" if q_dtype == "fp8" else "")  # (bf16 over bf16: no E4M3)
    spills = _sm80_spills("--layouts", layouts, "--batches", "64", "--q-dtype", q_dtype)
    spills |= _sm80_spills("--layouts", layouts, "--batches", "16" if q_dtype == "fp8" else "256", "--query-len", "4",
                           "--variant", '{"dedup": true}', "--q-dtype", q_dtype)
    kernels = {k.split()[0] for k in spills}
    assert {"split_decode_kernel", "nvfp4_decode_kernel", "split_dedup_kernel"} <= kernels, spills
    assert max(spills.values()) <= 264, spills


_WRITERS_FOR_SM80 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from msa.layouts.kernels import nvfp4_write_kernel, split_write_kernel

strides = ("stride_kt", "stride_kh", "stride_vt", "stride_vh")
split = dict(key_ptr="*bf16", value_ptr="*bf16", slot_ptr="*i64", k_cache_ptr="*u8", v_cache_ptr="*u8",
             k_scale_ptr="*fp32", v_scale_ptr="*fp32", capacity="i64",
             **{n: "i64" for n in (*strides, "stride_kcp", "stride_kch", "stride_kct", "stride_vcp", "stride_vch",
                                   "stride_vct")}, HEAD_DIM="constexpr", PAGE="constexpr", FP8="constexpr",
             SOFT="constexpr")
nvfp4 = dict(key_ptr="*bf16", value_ptr="*bf16", slot_ptr="*i64", cache_ptr="*u8", k_scale_ptr="*fp32",
             v_scale_ptr="*fp32", capacity="i64", **{n: "i64" for n in (*strides, "stride_cp", "stride_ch")},
             HEAD_DIM="constexpr", PAGE="constexpr", SOFT="constexpr")
a100 = GPUTarget("cuda", 80, 32)
triton.compile(ASTSource(split_write_kernel, split, dict(HEAD_DIM=128, PAGE=128, FP8=True, SOFT=True)), target=a100)
triton.compile(ASTSource(nvfp4_write_kernel, nvfp4, dict(HEAD_DIM=128, PAGE=128, SOFT=True)), target=a100)
print("bits: compiled")
hardware = dict(split, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
try:
    triton.compile(ASTSource(split_write_kernel, hardware, dict(HEAD_DIM=128, PAGE=128, FP8=True, SOFT=False)),
                   target=a100)
    print("hardware: compiled")
except Exception as exc:
    print("hardware: refused", "fp8e4nv" in str(exc))
"""


def test_the_writers_compile_for_sm80() -> None:
    """Both Triton cache writers, encoding E4M3 by bits, compile for an A100 (sm_80); with the
    hardware conversion the fp8 one does not (Triton has no fp8e4nv there)."""
    done = subprocess.run([sys.executable, "-c", _WRITERS_FOR_SM80], env=compiler_env(), capture_output=True,
                          text=True, timeout=600, check=False)
    if "bits: compiled" not in done.stdout and "ptxas" in done.stderr:
        pytest.skip(f"no ptxas for sm_80 here: {done.stderr[-300:]}")
    assert "bits: compiled" in done.stdout and "hardware: refused True" in done.stdout, done.stderr[-2000:]
