"""Conformance harness: msa's adapters against the real Python code of vLLM 0.33.0's
`fmha_sm100` and FlashInfer 0.7.2.post1's `msa_ops`, on the CPU.

Everything the libraries do in Python runs for real — their argument validation, plan-option
parsing, planners, route selection, layout checks, workspace rules. Intercepted are only:

- the compiled code: fmha_sm100's plan kernel (`api._call_plan`), kernel variants
  (`api.get_fmha_variant`), split-KV reductions and Q8KV4 kernels; FlashInfer's generated programs
  (`_blackwell_sm100.load_blackwell_msa_module`) and its 12.x CuTe-DSL kernel (a pre-filled
  compile cache). Each stand-in reads its arguments the way the kernel does — by the binding's
  parameter types (parsed from fmha_sm100's own `fmha_sm100_variant_run.cu.jinja`) or the
  program's argument plan (FlashInfer's `MODULES[...]["arg_plan"]`), tensors a pointer-only
  binding receives read as compact from their data pointer — and computes the output from them
  (tests/fakes/fake_attend.py), so a wrong argument gives a wrong result or a failed check;
- device queries answered as for a CUDA device (SM count, compute capability, the current stream,
  graph capture, `q.is_cuda`) and one import fmha_sm100 cannot do without nvidia-cutlass-dsl (its
  CuTe-DSL sparse *prefill* adapter, which decode never reaches).

fmha_sm100's own input validation (`check_input_valid`, off by default) is switched on for every
call: it checks the index lists (ascending, -1 only at the tail, in range), the page pointers
and the work lists that the kernels take on trust.

vLLM 0.33.0's MiniMax-M3 attention modules and plugin loader (`vllm_m3`, test_vllm_plugin.py)
run as they are — `vllm.plugins.load_general_plugins`, `vllm.envs`, the M3 backends' `forward`
under vLLM's own forward context — with one thing held back: the body of the package
`vllm.models.minimax_m3/__init__.py`, which imports the whole model (its vision tower needs
torchvision, its layers vLLM's compiled ops); the package is registered with its real `__path__`,
so its attention modules import from the wheel's files. SGLang 0.5.23's `minimax_sparse_decode`
(test_sglang_minimax.py) runs as it is, with its one Triton kernel call intercepted.

`make conformance` installs the packages (tests/conformance/install.py); without them every test
here is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import math
import os
import re
import sys
import threading
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import msa
import msa.backends.flashinfer
import msa.planner
import msa.platform
from msa.planner import DecodePlanner
from msa.platform import Platform
from msa.policy import SelectionPolicy
from msa.problem import DecodeProblem
from msa.registry import BackendRegistry
from msa.validation import check_decode_inputs

VLLM = ("vllm", "0.33.0")
FLASHINFER = ("flashinfer-python", "0.7.2.post1")
PREFILL_ADAPTER = "vllm.third_party.fmha_sm100.sparse_fmha_adapter"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _load_attend() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    path = Path(__file__).parents[1] / "fakes" / "fake_attend.py"
    spec = importlib.util.spec_from_file_location("conformance_fake_attend", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.attend  # type: ignore[no-any-return]


attend = _load_attend()


def require(distribution: str, version: str) -> None:
    """Skip unless the pinned package is importable (fail instead under `make conformance`,
    which sets MSA_CONFORMANCE=1)."""
    missing = pytest.fail if os.environ.get("MSA_CONFORMANCE", "") not in ("", "0") else pytest.skip
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        missing(f"{distribution} {version} is not installed (`make conformance` installs it)")
    if found != version:
        missing(f"conformance is pinned to {distribution} {version}, found {found}")


def compact(t: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """What a kernel that takes only `t`'s data pointer reads: a compact row-major `shape`
    (default `t`'s) from that address. A strided `t` reads other elements (or fails: outside its
    storage) — as the kernel would."""
    shape = tuple(t.shape) if shape is None else shape
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return t.as_strided(shape, tuple(reversed(strides)), t.storage_offset())


class CudaLike(torch.Tensor):
    """A CPU tensor that answers `is_cuda` (the one device query FlashInfer makes of `q`)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def cuda_like(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(CudaLike)


def pretend(capability: tuple[int, int]) -> Platform:
    """A pretend CUDA machine with the packages this process really has."""
    msa.platform._detect.cache_clear()
    return Platform.cuda(capability, packages=tuple(msa.platform.detect("cpu").packages))


def make_planner(kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch, platform: Platform, backend: str = "auto",
                 lse: bool = False) -> DecodePlanner:
    """A planner on the pretend machine for this step, told the step's cache form."""
    problem, _ = check_decode_inputs(**kw)
    options: dict[str, Any] = dict(
        kv_cache_dtype=problem.kv_layout, backend=backend, device="cpu", q_dtype=torch.float8_e4m3fn,
        with_lse=lse, platform=platform, policy=SelectionPolicy(BackendRegistry(environ={}), environ={}),
    )
    if "kv_form" in inspect.signature(DecodePlanner).parameters:
        return DecodePlanner(problem.geometry, kv_form=problem.kv_form, **options)
    # until the planner is told the cache form, the problems it builds say "packed": describe this one
    monkeypatch.setattr(msa.planner, "DecodeProblem", functools.partial(DecodeProblem, kv_form=problem.kv_form))
    return DecodePlanner(problem.geometry, **options)


def run_step(planner: DecodePlanner, kw: dict[str, Any], out: torch.Tensor | None = None,
             lse: bool = False) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """Plan and run one step into NaN-poisoned outputs: (the backend's plan, out, lse)."""
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=kw["decode_query_len"])
    if out is None:
        out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16)
    lse_t = torch.full(kw["q"].shape[:2], float("nan")) if lse else None
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, lse=lse_t,
                k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    return plan.backend_plan, out, lse_t


# -- vLLM 0.33.0 fmha_sm100 ---------------------------------------------------------------------------

_C_TYPES = {
    "ffi::TensorView": lambda v: isinstance(v, torch.Tensor),
    "Optional<ffi::TensorView>": lambda v: v is None or isinstance(v, torch.Tensor),
    "double": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "int64_t": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
}


@functools.cache
def binding_parameters(csrc: str, kv_mode: int) -> tuple[tuple[str, str], ...]:
    """`(C++ type, name)` of `FMHAVariantRun_*`, from the library's own binding template."""
    import jinja2

    text = (Path(csrc) / "fmha_sm100_variant_run.cu.jinja").read_text()
    rendered = jinja2.Template(text).render(variant_name="v", func_name="f", kv_mode=kv_mode, kv_suffix="")
    body = re.search(r"void FMHAVariantRun_v\((.*?)\)\s*\{", rendered, re.S)
    assert body is not None, "the binding's signature moved"
    params = []
    for part in body.group(1).split(","):
        ctype, name = part.split()[-2:]
        params.append((ctype, name))
    return tuple(params)


class FmhaHarness:
    """Stands in for fmha_sm100's compiled code and records what reached it."""

    def __init__(self, api: types.ModuleType, jit: types.ModuleType, q8: types.ModuleType) -> None:
        self.api, self.jit, self.q8 = api, jit, q8
        self.csrc = str(Path(jit.__file__).parent / "csrc")
        self.plans: list[dict[str, Any]] = []
        self.variants: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.q8kv4_plans: list[dict[str, Any]] = []
        self.q8kv4_runs: list[dict[str, Any]] = []
        self._call_plan_signature = inspect.signature(api._call_plan)

    # the plan kernel: a valid no-split work list, every (row, packed head) on CTA 0
    def plan_kernel(self, *args: Any, **kw: Any) -> None:
        bound = self._call_plan_signature.bind(*args, **kw).arguments
        self.plans.append(dict(bound))
        rows, heads = bound["qo_segment_lens"].shape[0], bound["num_qo_heads"]
        items = torch.tensor([r | (h << 16) for r in range(rows) for h in range(heads)], dtype=torch.int64)
        bound["packed_work_info"][: items.numel()].copy_(items)
        bound["packed_work_range"].zero_()
        bound["packed_work_range"][0] = items.numel() << 32
        if bound["out_max_sm_cost"] is not None:
            bound["out_max_sm_cost"].copy_(torch.tensor([0.0, 1.0]))  # do not split

    def get_variant(self, dtype_code: int, qo_tile_size: int, single_wg: bool, sparse_mode: int, page_size: int,
                    split_kv: bool, pack_factor: int, kv_dtype: str | None = None) -> Any:
        name, params = self.jit._variant_key_from_runtime(
            dtype_code, qo_tile_size, single_wg, sparse_mode, page_size, split_kv, pack_factor, kv_dtype)
        self.variants.append(dict(params, name=name))
        return types.SimpleNamespace(run=functools.partial(self.kernel, params))

    def no_reduction(self, nvfp4: bool = False) -> Any:
        raise AssertionError("split-KV reduction reached: the plan-kernel stand-in never splits")

    def q8kv4_plan(self, **kw: Any) -> Any:
        self.q8kv4_plans.append(kw)
        return types.SimpleNamespace(batch_size=kw["batch_size"], q_len_per_req=kw["q_len_per_req"],
                                     num_kv_heads=kw["num_kv_heads"], topk=kw["topk"], unit_scale=torch.ones(1))

    def q8kv4_run(self, plan: Any, q: torch.Tensor, kv: Any, **kw: Any) -> torch.Tensor:
        # Not modelled: the Q8KV4 kernel reads the plan-time `seq_lens` and `kv_indptr`
        self.q8kv4_runs.append(kw)
        kw["out"].fill_(float("nan"))
        return kw["out"]  # type: ignore[no-any-return]

    def kernel(self, params: dict[str, Any], *args: Any) -> None:
        """`FMHAVariantRun_*`: check the arguments against the binding's C++ types, then compute
        what the kv_mode 0/3 sparse decode kernel computes from them."""
        kv_mode = params["kv_mode"]
        signature = binding_parameters(self.csrc, kv_mode)
        assert len(args) == len(signature), f"{len(args)} arguments for {len(signature)} parameters"
        a: dict[str, Any] = {}
        for (ctype, name), value in zip(signature, args, strict=True):
            assert _C_TYPES[ctype](value), f"{name}: the binding takes {ctype}, got {type(value).__name__}"
            a[name] = value
        self.runs.append(dict(a, params=params))
        q, k = a["q"], a["k"]
        rows, hq, d = q.shape
        q_read = compact(q) if a["pack_factor"] > 1 else q  # a GQA-packed q is addressed compactly
        pages, hkv, page = k.shape[0], k.shape[1], k.shape[2]
        ids = a["maybe_kv_block_indexes"]
        ids = compact(ids, (rows, hkv, ids.shape[2]))
        table = compact(a["maybe_kv_indices"])
        indptr = compact(a["maybe_kv_page_indptr"])
        kv_lens, q_pos = a["kv_segment_lens"], a["maybe_qo_offsets"]
        spec = []
        for r in range(rows):
            n = min(int(q_pos[r]) + 1, int(kv_lens[r]))  # causal, inside the segment
            per_head = []
            for h in range(hkv):
                blocks = [j for j in ids[r, h].tolist() if j >= 0]
                where = [int(indptr[r]) + j for j in blocks]
                assert all(0 <= w < table.numel() for w in where), f"row {r}: page pointer outside kv_indices"
                page_ids = [int(table[w]) for w in where]
                assert all(0 <= p < pages for p in page_ids), f"row {r}: the kernel would read page {page_ids} outside the cache"
                per_head.append((blocks, page_ids, n))
            spec.append(per_head)
        if kv_mode >= 3:
            dequant = self._nvfp4_reader(a, pages, hkv, page, d)
        else:
            k_scale, v_scale = a["scale_k"], a["scale_v"]

            def dequant(page_ids: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
                return k[page_ids, h].float() * k_scale, a["v"][page_ids, h].float() * v_scale

        assert a["o_scale"] == 1.0, "o_scale != 1 is not modelled"
        out, _ = attend(q_read.float(), a["sm_scale"] * a["scale_q"], dequant, spec, hkv)
        o = a["maybe_o"]
        compact(o, (rows, hq, d)).copy_(out.to(o.dtype))

    @staticmethod
    def _nvfp4_reader(a: dict[str, Any], pages: int, hkv: int, page: int, d: int) -> Callable[..., Any]:
        """E2M1 codes and E4M3 block scales read through the page/head strides the binding got."""
        page_stride = a["nvfp4_page_stride"]
        globals_ = []
        for side in ("k", "v"):
            g = a[f"nvfp4_{side}_global_scale"]
            assert g.dtype == torch.float32 and g.numel() == 1, f"nvfp4_{side}_global_scale: one fp32 element"
            globals_.append(float(g.reshape(())))
        sides = []
        for side in ("k", "v"):
            data = a[f"maybe_nvfp4_{side}_data"].as_strided(
                (pages, hkv, page, d // 2), (page_stride, a["nvfp4_head_stride_data"], d // 2, 1),
                a[f"maybe_nvfp4_{side}_data"].storage_offset())
            scales = a[f"maybe_nvfp4_{side}_scale"].as_strided(
                (pages, hkv, page * d // 16), (page_stride, a["nvfp4_head_stride_scale"], 1),
                a[f"maybe_nvfp4_{side}_scale"].storage_offset())
            sides.append((data, scales))
        t = torch.arange(page).view(-1, 1)
        g = torch.arange(d // 16).view(1, -1)
        k_pos, v_pos = t * (d // 16) + g, (t // 4) * (4 * d // 16) + g * 4 + t % 4

        def dequant(page_ids: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
            result = []
            for (data, scales), pos, scale in zip(sides, (k_pos, v_pos), globals_, strict=True):
                raw = data[page_ids, h].long()  # [n, P, D/2]
                codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(len(page_ids), page, d)
                block = scales[page_ids, h][:, pos].view(torch.float8_e4m3fn).float()  # [n, P, D/16]
                result.append(E2M1[codes] * block.repeat_interleave(16, dim=-1) * scale)
            return result[0], result[1]

        return dequant


def _prefill_adapter_stub() -> types.ModuleType:
    stub = types.ModuleType(PREFILL_ADAPTER)
    stub.__doc__ = "Stand-in for the CuTe-DSL sparse prefill adapter (needs nvidia-cutlass-dsl); decode never reaches it."

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("fmha_sm100's CuTe-DSL sparse prefill path was reached")

    stub.sparse_fmha = stub.sparse_fmha_plan = unreachable  # type: ignore[attr-defined]
    return stub


@pytest.fixture
def fmha(monkeypatch: pytest.MonkeyPatch) -> FmhaHarness:
    require(*VLLM)
    if PREFILL_ADAPTER not in sys.modules:
        try:
            importlib.import_module(PREFILL_ADAPTER)
        except ImportError:
            sys.modules[PREFILL_ADAPTER] = _prefill_adapter_stub()
    api = importlib.import_module("vllm.third_party.fmha_sm100.api")
    jit = importlib.import_module("vllm.third_party.fmha_sm100.jit")
    q8 = importlib.import_module("vllm.third_party.fmha_sm100.q8kv4_decode_adapter")
    h = FmhaHarness(api, jit, q8)
    # compiled code
    monkeypatch.setattr(api, "_call_plan", h.plan_kernel)
    monkeypatch.setattr(api, "get_fmha_variant", h.get_variant)
    monkeypatch.setattr(api, "get_reduction_module", h.no_reduction)
    monkeypatch.setattr(q8, "plan_decode", h.q8kv4_plan)
    monkeypatch.setattr(q8, "run_decode", h.q8kv4_run)
    # device queries, answered as for a CUDA device with 148 SMs
    monkeypatch.setattr(api, "_NUM_CTA", 148)
    monkeypatch.setattr(api, "_workspace_cache", defaultdict(lambda: [None] * api._BuffTag.Total))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(q8, "_cuda_device", lambda device: torch.device(device))
    # the library's own input validation, on for every call
    monkeypatch.setattr(api, "_fmha_sm100", functools.partial(api._fmha_sm100, check_input_valid=True))
    return h


# -- FlashInfer 0.7.2.post1 msa_ops ------------------------------------------------------------------


class FlashInferHarness:
    """Stands in for FlashInfer's compiled MSA programs and records what reached them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.ops = importlib.import_module("flashinfer.msa_ops")
        self.decode = importlib.import_module("flashinfer.msa_ops.sparse_decode")
        self.sm100 = importlib.import_module("flashinfer.msa_ops._blackwell_sm100")
        jit = importlib.import_module("flashinfer.jit.blackwell_msa")
        self.programs = jit.MODULES
        self.route = functools.partial(jit.route_program, target="sm100a")
        #: the library's own answer, before `use_10x` / `use_12x` pretend a device
        self.supports_packed_kv = self.ops.supports_packed_kv
        self.launches: list[dict[str, Any]] = []
        self.sm12x_calls: list[dict[str, Any]] = []
        self.capturing = False

    def load_module(self, name: str, target: str) -> Any:
        record = self.programs[name]
        names = [argument for _, argument in record["arg_plan"]]
        return types.SimpleNamespace(**{record["ffi_entry"]: functools.partial(self.program, name, names)})

    def program(self, name: str, names: list[str], *values: Any) -> None:
        """A generated program: its arguments by the program's own argument plan."""
        a = dict(zip(names, values, strict=True))
        self.launches.append(dict(a, program=name))
        assert "task_kind" in a and "output_scale" in a, f"program {name}: not the uniform-FP8 decode route"
        q = compact(a["Q"]).view(torch.float8_e4m3fn)
        k = compact(a["K"]).view(torch.float8_e4m3fn)
        v = compact(a["V"]).view(torch.float8_e4m3fn)
        total_q, hq, hkv, length = a["total_q"], a["num_q_heads"], a["num_kv_heads"], a["seqlen_q"]
        q2k = compact(a["task_kind"], (hkv, total_q, a["task_kind"].shape[-1]))
        width = a["msa_max_pages"]
        table = compact(a["kv_indices"]).reshape(-1)
        lens = compact(a["kv_indptr"])
        self._attend(q, k, v, q2k, table, width, lens, length, a["softmax_scale_log2"] * math.log(2.0),
                     a["output_scale"], compact(a["O"], (total_q, hq, 128)), compact(a["msa_lse"], (total_q, hq)))

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q2k: torch.Tensor, table: torch.Tensor,
                width: int, lens: torch.Tensor, length: int, scale: float, output_scale: float,
                out: torch.Tensor, lse: torch.Tensor) -> None:
        """FlashInfer's decode semantics (its reference, flashinfer/trace/templates/msa.py): query
        i of request b at seqused_k[b] - seqlen_q + i; ids < 0 or past ceil(len / 128) dropped."""
        total_q, hkv = q.shape[0], k.shape[1]
        spec = []
        for r in range(total_q):
            b, i = divmod(r, length)
            n = max(int(lens[b]) - length + i + 1, 0)
            visible = -(-int(lens[b]) // 128)
            per_head = []
            for h in range(hkv):
                blocks = sorted({j for j in q2k[h, r].tolist() if 0 <= j < visible})
                page_ids = [int(table[b * width + j]) for j in blocks]
                assert all(0 <= p < k.shape[0] for p in page_ids), f"row {r}: the kernel would read page {page_ids} outside the cache"
                per_head.append((blocks, page_ids, n))
            spec.append(per_head)

        def dequant(page_ids: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
            return k[page_ids, h].float(), v[page_ids, h].float()

        result, result_lse = attend(q.float(), scale, dequant, spec, hkv)
        out.copy_((result * output_scale).to(out.dtype))
        lse.copy_(result_lse.to(lse.dtype))

    def sm12x_kernel(self, key: tuple[Any, ...], *values: Any) -> None:
        """The 12.x CuTe-DSL decode kernel, called with the arguments of its compiled signature."""
        (q, k_pass, v_pass, table, _, _, q2k, _, _, _, out_buf, lse_buf, lens, _, scale, out_scale, length,
         total_q, hkv, num_chunks) = values
        self.sm12x_calls.append({"key": key, "k": k_pass, "v": v_pass, "page_table": table, "num_chunks": num_chunks})
        assert key[10] is True and num_chunks == 1, "the fused path (force_fused=True)"
        if k_pass.dim() == 5:  # a packed cache: the kernel picks the K / V plane itself
            k, v = k_pass[:, :, :, 0], k_pass[:, :, :, 1]
        else:
            k, v = k_pass, v_pass
        self._attend(q, k, v, q2k, table.reshape(-1), table.shape[1], lens, length, scale, out_scale, out_buf, lse_buf)

    def use_10x(self) -> None:
        """A compute-capability 10.0 device: the SM100 routes."""
        mp = self.monkeypatch
        mp.setattr(self.decode, "is_blackwell_msa_device", lambda device: True)
        mp.setattr(self.ops, "supports_packed_kv", lambda device: False)

    def use_12x(self) -> None:
        """A compute-capability 12.0 device: the CuTe-DSL route, its kernel compiled already."""
        mp = self.monkeypatch
        mp.setattr(self.decode, "is_blackwell_msa_device", lambda device: False)
        mp.setattr(self.ops, "supports_packed_kv", lambda device: True)
        mp.setattr(importlib.import_module("flashinfer.utils"), "is_sm12x_supported", lambda device: True)
        for name in ("cutlass", "cutlass.cute", "flashinfer.msa_ops.cute_dsl.sparse_decode_sm12x"):
            try:
                importlib.import_module(name)
            except ImportError:  # nvidia-cutlass-dsl: only the compiler needs it, and nothing compiles
                stub = types.ModuleType(name)
                stub.SparseDecodeForwardSm12x = object  # type: ignore[attr-defined]
                mp.setitem(sys.modules, name, stub)
        dummies = (torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.uint8),
                   torch.zeros(1, dtype=torch.int32))
        mp.setattr(self.decode, "_dummy_tensors", lambda index: dummies)
        harness = self

        class Compiled(dict):  # type: ignore[type-arg]
            def get(self, key: Any, default: Any = None) -> Any:
                return functools.partial(harness.sm12x_kernel, key) if key[0] == "decode" else default

        mp.setattr(self.decode, "_compile_cache", Compiled())


def _workspace_on_any_device(self: Any, device: torch.device | str) -> None:
    """`MSASparseAttentionWorkspace.__init__` without its CUDA-device check (the same fields)."""
    self.device = torch.device(device)
    self._lock = threading.Lock()
    self._buffers = {}
    self._long_prefill_state = {}
    self._warmed_launches = set()
    self._bound_stream_ptr = None
    self._captured = False


@pytest.fixture
def flashinfer(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlashInferHarness]:
    require(*FLASHINFER)
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path_factory.mktemp("flashinfer")))
    h = FlashInferHarness(monkeypatch)
    bw = h.sm100
    # compiled programs
    monkeypatch.setattr(bw, "load_blackwell_msa_module", h.load_module)
    bw._program.cache_clear()
    # device queries, answered as for a CUDA device
    monkeypatch.setattr(bw, "_select_target", lambda device: "sm100a")
    monkeypatch.setattr(bw, "_num_sms", lambda device: 148)
    monkeypatch.setattr(bw, "_stream_ptr", lambda device: 0)
    monkeypatch.setattr(bw, "_normalize_device", lambda device: device)
    monkeypatch.setattr(bw.MSASparseAttentionWorkspace, "__init__", _workspace_on_any_device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: h.capturing)
    tvm_ffi = importlib.import_module("tvm_ffi")
    monkeypatch.setattr(tvm_ffi, "use_torch_stream", contextlib.nullcontext)
    h.use_10x()
    yield h
    bw._program.cache_clear()


# -- vLLM 0.33.0's MiniMax-M3 attention backends and plugin loader ---------------------------------

M3_PACKAGE = "vllm.models.minimax_m3"
M3_OPS = "vllm.models.minimax_m3.common.ops.sparse_attn"


@functools.cache
def _m3_package() -> None:
    """`vllm.models.minimax_m3` with its real `__path__` but without running its `__init__`
    (the whole model: torchvision, vLLM's compiled ops), so the attention modules load alone."""
    if M3_PACKAGE in sys.modules:
        return
    vllm = importlib.import_module("vllm")
    root = Path(vllm.__file__).parent / "models" / "minimax_m3"
    spec = importlib.machinery.ModuleSpec(M3_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(root)]
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(root)]
    sys.modules[M3_PACKAGE] = package


class VllmM3:
    """vLLM's plugin loader and the M3 modules the plugin patches, with msa's plugin module."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from msa.integrations import vllm_plugin

        self.monkeypatch = monkeypatch
        self.plugin = vllm_plugin
        self.plugins = importlib.import_module("vllm.plugins")
        self.forward_context = importlib.import_module("vllm.forward_context")
        self.ops = importlib.import_module(M3_OPS)
        self.common, self.nvidia = (importlib.import_module(name) for name in vllm_plugin.CALL_SITES)

    def load_general_plugins(self) -> None:
        """vLLM's own loader, as a fresh vLLM process runs it."""
        self.monkeypatch.setattr(self.plugins, "plugins_loaded", False)
        self.plugins.load_general_plugins()

    def unload_call_sites(self) -> None:
        """Forget the call-site modules (restored after the test), so the next import runs them."""
        for name in self.plugin.CALL_SITES:
            self.monkeypatch.delitem(sys.modules, name)

    def call_sites(self) -> list[types.ModuleType]:
        return [importlib.import_module(name) for name in self.plugin.CALL_SITES]

    @staticmethod
    def routed(module: types.ModuleType) -> bool:
        return bool(getattr(module.minimax_m3_sparse_attn_decode, "__msa_routed__", False))


@pytest.fixture
def vllm_m3(monkeypatch: pytest.MonkeyPatch) -> Iterator[VllmM3]:
    require(*VLLM)
    _m3_package()
    for name in ("VLLM_PLUGINS", "MSA_VLLM_PLUGIN", "MSA_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    h = VllmM3(monkeypatch)
    assert not any(h.routed(m) for m in (h.common, h.nvidia)), "a previous test left msa's routing in place"
    yield h
    h.plugin.unregister()
