"""The selection policy on hand-built platforms: every docs/semantics.md §7 rule on both sides of its boundary."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

import msa
from msa.backends.cutlass_sm100 import MIN_BATCH_ENV
from msa.errors import MSAInputError, MSAUnsupportedError
from msa.platform import Platform
from msa.policy import SelectionPolicy
from msa.problem import DecodeProblem
from msa.registry import BackendRegistry

ALL = ("fmha_sm100", "flashinfer", "triton")
SM90, SM100, SM103, SM107, SM110, SM120, SM121 = (
    Platform.cuda(c, packages=ALL) for c in ((9, 0), (10, 0), (10, 3), (10, 7), (11, 0), (12, 0), (12, 1))
)
CPU = Platform("cpu")


def problem(
    heads: tuple[int, int] = (64, 4),
    *,
    layout: str = "fp8_e4m3",
    batch: int = 64,
    length: int = 1,
    page: int = 128,
    topk: int = 16,
    head_dim: int = 128,
    q: torch.dtype = torch.float8_e4m3fn,
    lse: bool = False,
    form: str = "packed",
    capture: bool = False,
) -> DecodeProblem:
    return DecodeProblem(
        geometry=msa.Geometry(heads[0], heads[1], head_dim, page, topk),
        batch_size=batch,
        query_len=length,
        kv_layout=layout,
        q_dtype=q,
        out_dtype=torch.bfloat16,
        device_type="cuda",
        num_pages=10_000,
        max_blocks=512,
        return_lse=lse,
        kv_form=form,
        graph_capture=capture,
    )


@pytest.fixture(scope="module")
def policy() -> SelectionPolicy:
    return SelectionPolicy(BackendRegistry(environ={}), environ={})


def reasons(policy: SelectionPolicy, name: str, p: DecodeProblem, platform: Platform = SM100, requested: bool = True) -> list[str]:
    selection = policy.evaluate(p, platform, name if requested else "auto")
    return selection.rejected.get(name, [])


CUTLASS_CASES: list[tuple[str, dict[str, Any], Platform, str | None]] = [
    # (case, problem changes, platform, expected reason fragment or None = qualifies)
    ("sm90", {}, SM90, "needs compute capability 10.x, this device is 9.0"),
    ("sm100", {}, SM100, None),
    ("sm103", {}, SM103, None),
    ("sm107", {}, SM107, None),
    ("sm110", {}, SM110, "needs compute capability 10.x, this device is 11.0"),
    ("sm120", {}, SM120, "needs compute capability 10.x, this device is 12.0"),
    ("cpu", {}, CPU, "runs on cuda, not cpu"),
    ("no library", {}, Platform.cuda((10, 0), packages=("triton",)), "needs the package(s) fmha_sm100"),
    ("tp1 64/4", {"heads": (64, 4)}, SM100, None),
    ("tp2 32/2", {"heads": (32, 2)}, SM100, None),
    ("tp4 16/1", {"heads": (16, 1)}, SM100, None),
    ("tp8 8/1", {"heads": (8, 1)}, SM100, None),
    ("72/4", {"heads": (72, 4)}, SM100, "needs Hq <= 64, got 72"),
    ("64/8", {"heads": (64, 8)}, SM100, "needs Hkv <= 4, got 8"),
    ("page 64", {"page": 64}, SM100, "needs page size in {128}, got 64"),
    ("top-k 8", {"topk": 8}, SM100, "needs top-k in {16}, got 8"),
    ("head dim 64", {"head_dim": 64}, SM100, "needs head dim in {128}, got 64"),
    ("L=0", {"length": 0}, SM100, "needs 1 <= L <= 32 query tokens per request, got 0"),
    ("L=1", {"length": 1}, SM100, None),
    ("L=32", {"length": 32, "batch": 32}, SM100, None),
    ("L=33", {"length": 33, "batch": 16}, SM100, "needs 1 <= L <= 32 query tokens per request, got 33"),
    ("fp8 B=15", {"batch": 15}, SM100, "needs a batch of >= 16 requests (unless the cache is nvfp4), got 15"),
    ("fp8 B=16", {"batch": 16}, SM100, None),
    ("nvfp4 B=15", {"batch": 15, "layout": "nvfp4"}, SM100, None),
    ("nvfp4 B=16", {"batch": 16, "layout": "nvfp4"}, SM100, None),
    ("nvfp4 B=1", {"batch": 1, "layout": "nvfp4"}, SM100, None),
    ("rows 65536", {"batch": 1024}, SM100, None),
    ("rows 65600", {"batch": 1025}, SM100, "needs B*L*Hq <= 65536 query-head rows, got 65600"),
    ("rows 65536 (1 head)", {"heads": (1, 1), "batch": 65536}, SM100, None),
    ("rows 65537 (1 head)", {"heads": (1, 1), "batch": 65537}, SM100, "got 65537"),
    ("rows L=4", {"batch": 256, "length": 4}, SM100, None),
    ("rows L=4 past", {"batch": 257, "length": 4}, SM100, "got 65792"),
    ("bf16 cache", {"layout": "bfloat16"}, SM100, "reads fp8_e4m3, nvfp4 caches, not bfloat16"),
    ("bf16 q", {"q": torch.bfloat16}, SM100, "takes q in float8_e4m3fn, not bfloat16"),
    ("lse", {"lse": True}, SM100, "does not return the log-sum-exp"),
    # kv_mode 3 serves any GQA group (the 8/16 condition was the Q8KV4 route's)
    ("nvfp4 group 4", {"heads": (16, 4), "layout": "nvfp4"}, SM100, None),
    ("nvfp4 group 1", {"heads": (4, 4), "layout": "nvfp4"}, SM100, None),
    ("separate K/V", {"form": "separate"}, SM100, None),
    ("strided K/V", {"form": "strided"}, SM100, None),
    ("graph capture", {"capture": True}, SM100, None),
    ("no requests", {"batch": 0, "layout": "nvfp4"}, SM100, "needs at least one request"),
]


@pytest.mark.parametrize("case, changes, platform, expected", CUTLASS_CASES, ids=[c[0] for c in CUTLASS_CASES])
def test_cutlass_rules(policy: SelectionPolicy, case: str, changes: dict[str, Any], platform: Platform, expected: str | None) -> None:
    why = reasons(policy, "cutlass_sm100", problem(**changes), platform)
    if expected is None:
        assert why == [], why
    else:
        assert any(expected in r for r in why), why


@pytest.fixture(autouse=True)
def _no_batch_floor_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MIN_BATCH_ENV, raising=False)


#: vLLM 0.33's CUTLASS batch floor for fp8 caches: (case, heads, L, platform, floor). 16 requests,
#: except on compute capability 10.3 for L <= 8 and MiniMax-M3's heads per rank, where it is
#: ceil(1024 / (L * Hq)) (`_min_cutlass_batch_size` in vLLM's msa_cutlass_sparse_decode.py).
BATCH_FLOORS: list[tuple[str, tuple[int, int], int, Platform, int]] = [
    ("sm100 64/4 L=1", (64, 4), 1, SM100, 16),
    ("sm100 64/4 L=8 (10.3 only)", (64, 4), 8, SM100, 16),
    ("sm107 64/4 L=4 (10.3 only)", (64, 4), 4, SM107, 16),
    ("sm103 64/4 L=1", (64, 4), 1, SM103, 16),
    ("sm103 64/4 L=2", (64, 4), 2, SM103, 8),
    ("sm103 64/4 L=3", (64, 4), 3, SM103, 6),
    ("sm103 64/4 L=4", (64, 4), 4, SM103, 4),
    ("sm103 64/4 L=8", (64, 4), 8, SM103, 2),
    ("sm103 64/4 L=9 (past L <= 8)", (64, 4), 9, SM103, 16),
    ("sm103 32/2 L=1", (32, 2), 1, SM103, 32),
    ("sm103 32/2 L=2", (32, 2), 2, SM103, 16),
    ("sm103 32/2 L=4", (32, 2), 4, SM103, 8),
    ("sm103 32/2 L=8", (32, 2), 8, SM103, 4),
    ("sm103 16/1 L=1", (16, 1), 1, SM103, 64),
    ("sm103 16/1 L=3", (16, 1), 3, SM103, 22),
    ("sm103 16/1 L=8", (16, 1), 8, SM103, 8),
    ("sm103 8/1 (not an M3 rank)", (8, 1), 2, SM103, 16),
    ("sm103 64/8 groups (not an M3 rank)", (32, 4), 2, SM103, 16),
]


@pytest.mark.parametrize("case, heads, length, platform, floor", BATCH_FLOORS, ids=[c[0] for c in BATCH_FLOORS])
def test_cutlass_batch_floor_on_both_sides(policy: SelectionPolicy, case: str, heads: tuple[int, int], length: int, platform: Platform, floor: int) -> None:
    below = reasons(policy, "cutlass_sm100", problem(heads, batch=floor - 1, length=length), platform)
    assert any(f"needs a batch of >= {floor} requests (unless the cache is nvfp4" in r and f"got {floor - 1}" in r for r in below), below
    assert reasons(policy, "cutlass_sm100", problem(heads, batch=floor, length=length), platform) == []
    # NVFP4 has no floor, on any machine
    assert reasons(policy, "cutlass_sm100", problem(heads, batch=1, length=length, layout="nvfp4"), platform) == []


@pytest.mark.parametrize("platform", [SM100, SM103], ids=["sm100", "sm103"])
def test_cutlass_batch_floor_override(policy: SelectionPolicy, platform: Platform, monkeypatch: pytest.MonkeyPatch) -> None:
    """`VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH` replaces the rule on every device (10.3's too)."""
    for value, length in ((4, 1), (32, 2), (2, 8)):
        monkeypatch.setenv(MIN_BATCH_ENV, str(value))
        below = reasons(policy, "cutlass_sm100", problem(batch=value - 1, length=length), platform)
        assert below == [f"needs a batch of >= {value} requests (unless the cache is nvfp4, {MIN_BATCH_ENV}={value}), got {value - 1}"]
        assert reasons(policy, "cutlass_sm100", problem(batch=value, length=length), platform) == []
    monkeypatch.setenv(MIN_BATCH_ENV, "many")
    assert reasons(policy, "cutlass_sm100", problem(), platform) == [f"{MIN_BATCH_ENV}='many' is not an int"]
    assert reasons(policy, "cutlass_sm100", problem(layout="nvfp4"), platform) == []


def test_unequal_group_is_refused_at_construction() -> None:
    with pytest.raises(MSAInputError, match="num_q_heads: expected a multiple of num_kv_heads=4, got 6"):
        problem((6, 4))


def test_cutlass_runs_by_itself_only_for_nvfp4(policy: SelectionPolicy) -> None:
    fp8 = policy.evaluate(problem(form="separate"), SM100)
    assert fp8.chosen == "flashinfer"
    assert "chosen automatically only for nvfp4 caches; request it by name for fp8_e4m3" in fp8.rejected["cutlass_sm100"]
    assert policy.evaluate(problem(), SM100, "cutlass").chosen == "cutlass_sm100"
    assert policy.evaluate(problem(layout="nvfp4"), SM100).chosen == "cutlass_sm100"


SEPARATE = {"form": "separate"}
PAIR_NEEDED = "on compute capability 10.x it reads separate contiguous K and V caches"
FLASHINFER_CASES: list[tuple[str, dict[str, Any], Platform, str | None]] = [
    ("sm100", SEPARATE, SM100, None),
    ("sm103", SEPARATE, SM103, None),
    ("sm107", SEPARATE, SM107, "needs compute capability 10.0, 10.3, 12.0, 12.1, this device is 10.7"),
    ("sm110", SEPARATE, SM110, "this device is 11.0"),
    ("sm120", SEPARATE, SM120, None),
    ("sm121", SEPARATE, SM121, None),
    ("sm90", SEPARATE, SM90, "this device is 9.0"),
    ("cpu", SEPARATE, CPU, "needs a CUDA device of compute capability 10.0, 10.3, 12.0, 12.1"),
    ("no flashinfer", SEPARATE, Platform.cuda((10, 0), packages=("fmha_sm100",)), "needs the package(s) flashinfer"),
    # K/V forms: 10.x reads two contiguous tensors only; 12.x also one compact packed cache
    ("sm100 packed", {"form": "packed"}, SM100, PAIR_NEEDED + ": pass a (k_cache, v_cache) pair of contiguous tensors (layout.allocate(..., separate=True)), not a packed cache"),
    ("sm103 strided", {"form": "strided"}, SM103, PAIR_NEEDED + ": pass a (k_cache, v_cache) pair of contiguous tensors (layout.allocate(..., separate=True)), not strided views"),
    ("sm120 packed", {"form": "packed"}, SM120, None),
    ("sm121 separate", {"form": "separate"}, SM121, None),
    ("sm120 strided", {"form": "strided"}, SM120, "reads contiguous caches (one compact packed tensor, or a (k_cache, v_cache) pair), not strided views"),
    ("group 16", {"heads": (64, 4), **SEPARATE}, SM100, None),
    ("group 32", {"heads": (64, 2), **SEPARATE}, SM100, "needs a GQA group <= 16, got 32"),
    ("L=8", {"length": 8, **SEPARATE}, SM100, None),
    ("L=32", {"length": 32, **SEPARATE}, SM100, None),
    ("L=33", {"length": 33, **SEPARATE}, SM100, "needs 1 <= L <= 32"),
    ("nvfp4", {"layout": "nvfp4", **SEPARATE}, SM100, "reads fp8_e4m3 caches, not nvfp4"),
    ("lse", {"lse": True, **SEPARATE}, SM100, None),
    ("small batch", {"batch": 1, **SEPARATE}, SM100, None),
    ("graph capture", {"capture": True, **SEPARATE}, SM100, "cannot run inside CUDA-graph capture: FlashInfer's graph workspace serves one captured call"),
    ("graph capture 12.x", {"capture": True}, SM120, "cannot run inside CUDA-graph capture"),
]


@pytest.mark.parametrize("case, changes, platform, expected", FLASHINFER_CASES, ids=[c[0] for c in FLASHINFER_CASES])
def test_flashinfer_rules(policy: SelectionPolicy, case: str, changes: dict[str, Any], platform: Platform, expected: str | None) -> None:
    why = reasons(policy, "flashinfer", problem(**changes), platform)
    assert (why == []) if expected is None else any(expected in r for r in why), why


def test_reference_runs_everywhere(policy: SelectionPolicy) -> None:
    for platform in (CPU, SM90, SM100, SM120):
        for p in (problem(q=torch.bfloat16, layout="bfloat16"), problem(length=32, page=16, topk=3, lse=True)):
            assert reasons(policy, "reference", p, platform) == []


def test_auto_takes_the_first_qualified_in_priority_order(policy: SelectionPolicy) -> None:
    assert policy.order() == ["cutlass_sm100", "flashinfer", "cute", "triton", "reference"]
    selection = policy.evaluate(problem(q=torch.bfloat16), SM100)
    assert selection.chosen == "triton"
    assert set(selection.rejected) == {"cutlass_sm100", "flashinfer", "cute"}
    text = selection.explain()
    assert "requested 'auto': runs on 'triton'" in text and "takes q in float8_e4m3fn, not bfloat16" in text
    assert policy.evaluate(problem(q=torch.bfloat16), CPU).chosen == "reference"


def test_custom_order(policy: SelectionPolicy) -> None:
    custom = SelectionPolicy(policy.registry, order=["reference", "flashinfer"], environ={})
    assert custom.evaluate(problem(form="separate"), SM100).chosen == "reference"


def test_explicit_request_that_cannot_serve_raises(policy: SelectionPolicy) -> None:
    with pytest.raises(MSAUnsupportedError, match=r"backend 'cutlass_sm100' cannot run this step .*\n  cutlass_sm100: needs compute capability 10.x, this device is 9.0"):
        policy.select(problem(), SM90, "cutlass")


def test_no_backend_raises_with_every_reason(policy: SelectionPolicy) -> None:
    only_external = SelectionPolicy(policy.registry, order=["cutlass_sm100", "flashinfer"], environ={})
    with pytest.raises(MSAUnsupportedError) as info:
        only_external.select(problem(), CPU)
    assert set(info.value.reasons) == {"cutlass_sm100", "flashinfer"}
    assert "no msa backend can run this step on cpu" in str(info.value)


def test_environment_override_acts_as_a_request(policy: SelectionPolicy) -> None:
    env = SelectionPolicy(policy.registry, environ={"MSA_BACKEND": "cutlass"})
    selection = env.evaluate(problem(), SM100)
    assert selection.chosen == "cutlass_sm100" and selection.via_environment
    with pytest.raises(MSAUnsupportedError, match=r"backend 'cutlass_sm100' \(from MSA_BACKEND\) cannot run"):
        env.select(problem(), SM90)
    with pytest.raises(MSAInputError, match="^MSA_BACKEND: expected 'auto' or one of .*got 'nope'"):  # (named as set)
        SelectionPolicy(policy.registry, environ={"MSA_BACKEND": "nope"}).evaluate(problem(), SM100)
    with pytest.raises(MSAInputError, match="^backend: expected 'auto' or one of .*got 'nope'"):
        SelectionPolicy(policy.registry, environ={}).evaluate(problem(), SM100, "nope")


def test_sparse_decode_honours_msa_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from msa.workload import make_decode_step

    step = make_decode_step(msa.Geometry(8, 2, 64, 16, 4), batch_size=2, context_len=100, seed=1)
    monkeypatch.setenv("MSA_BACKEND", "flashinfer")
    with pytest.raises(MSAUnsupportedError, match=r"backend 'flashinfer' \(from MSA_BACKEND\) cannot run this step on cpu"):
        msa.sparse_decode(**step.kwargs())


#: Pretend machines for the machine-level refusals: (id, platform).
MACHINES: list[tuple[str, Platform]] = [
    ("cpu", Platform("cpu", packages=frozenset(ALL))),
    ("cpu interpret", Platform("cpu", packages=frozenset(ALL), triton_interpret=True)),
    ("sm75", Platform.cuda((7, 5), packages=ALL)),
    ("sm80", Platform.cuda((8, 0), packages=ALL)),
    ("sm90", SM90),
    ("sm100", SM100),
    ("sm100 bare", Platform.cuda((10, 0), packages=())),
]

#: A step each built-in backend supports, so only the machine can refuse it.
FRIENDLY = {
    "cutlass_sm100": problem((64, 4), layout="nvfp4"),
    "flashinfer": problem(form="separate"),
    "triton": problem(q=torch.bfloat16),
    "reference": problem(q=torch.bfloat16, layout="bfloat16", lse=True),
}


@pytest.mark.parametrize("machine, platform", MACHINES, ids=[m[0] for m in MACHINES])
@pytest.mark.parametrize("requested", [False, True])
def test_machine_refusals_have_one_home(policy: SelectionPolicy, machine: str, platform: Platform, requested: bool) -> None:
    """`platform_reasons` (what `msa backends` shows) are exactly the refusals of a step the
    backend otherwise supports, and `not_supported_reasons` = platform + problem reasons."""
    for name, step in FRIENDLY.items():
        backend = policy.registry.get(name)
        on_machine = backend.platform_reasons(platform, requested=requested)
        assert backend.problem_reasons(step, platform, requested=requested) == [], (name, machine)
        assert backend.not_supported_reasons(step, platform, requested=requested) == on_machine, (name, machine)
        assert backend.not_supported_reasons(None, platform, requested=requested) == on_machine, (name, machine)


def test_triton_machine_refusals() -> None:
    triton = BackendRegistry(environ={}).get("triton")
    cpu = Platform("cpu", packages=frozenset({"triton"}))
    assert triton.platform_reasons(cpu) == ["runs on the CPU only under TRITON_INTERPRET=1"]
    interpret = attrs.evolve(cpu, triton_interpret=True)
    assert triton.platform_reasons(interpret, requested=True) == []
    assert triton.platform_reasons(interpret) == [
        "on the CPU it runs only through the Triton interpreter (slow): request it by name"
    ]
    sm75 = Platform.cuda((7, 5))
    assert triton.platform_reasons(sm75, requested=True) == ["needs compute capability >= 8.0, this device is 7.5"]
    assert triton.platform_reasons(Platform.cuda((8, 0))) == []
