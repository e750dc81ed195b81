"""The Triton launcher's arguments against each kernel's signature, on the CPU, for every layout,
cache form, strategy and option — and on both of the launcher's paths: the first call of a call
signature (arguments built in full) and every later one (the remembered static arguments plus the
call's tensors), which is the path the direct launches take on a GPU.

A kernel parameter the launcher does not pass, and that has no default, would fail the launch;
one with a default must be bound to that default by the direct launcher too (a dedup call made
twice once raised `KeyError: 'DECODE_ASM'` there). No kernel is launched here: these are the
arguments, checked against the signatures, so the test runs in CI without a GPU."""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import pytest
import torch
from cases import Case, build

from msa.backends.triton import TritonBackend
from msa.backends.triton.launch import bind_arguments, kernel_parameters, step_launches
from msa.planning import StepTables
from msa.validation import call_signature, check_decode_inputs

LAYOUTS = ("bfloat16", "float16", "fp8_e4m3", "nvfp4")
#: strategy -> TritonBackend overrides
STRATEGIES: dict[str, dict[str, Any]] = {
    "fused": dict(num_splits=1, dedup=False),
    "split, merge kernel": dict(num_splits=3, dedup=False, in_kernel_merge=False),
    "split, in-kernel merge": dict(num_splits=2, dedup=False, in_kernel_merge=True),
    "dedup": dict(dedup=True, num_splits=1),
    "dedup, split": dict(dedup=True, num_splits=2),
}
#: Triton launch options, not kernel parameters
LAUNCH_OPTIONS = {"num_warps", "num_stages"}


def _cases() -> list[tuple[str, str, bool, bool, bool, bool]]:
    found = []
    for layout, strategy, lse, ragged in itertools.product(LAYOUTS, STRATEGIES, (False, True), (False, True)):
        separate = layout != "nvfp4" and (lse != ragged)
        found.append((layout, strategy, lse, ragged, separate, lse))  # tensor scales with LSE
    return found


def _step(layout: str, ragged: bool, separate: bool, tensor_scales: bool,
          gen: torch.Generator) -> tuple[Any, Any, Any]:
    case = Case(layout=layout, batch=3, query_len=3, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                topk=3, max_blocks=5, tensor_scales=tensor_scales)
    kw = dict(build(case, gen).kwargs)
    if separate:
        cache = kw["kv_cache"]
        kw["kv_cache"] = (cache[..., :64].contiguous(), cache[..., 64:].contiguous())
    if ragged:
        kw["query_start_loc"] = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
        kw["q"] = kw["q"][:8]
        kw["topk_indices"] = kw["topk_indices"][:, :8]
    return kw, *check_decode_inputs(**kw, return_lse=True)


@pytest.mark.parametrize("layout, strategy, lse, ragged, separate, tensor_scales", _cases())
def test_every_kernel_gets_every_parameter(layout: str, strategy: str, lse: bool, ragged: bool, separate: bool,
                                           tensor_scales: bool, gen: torch.Generator) -> None:
    kw, problem, inputs = _step(layout, ragged, separate, tensor_scales, gen)
    backend = TritonBackend(**STRATEGIES[strategy])
    plan = backend.plan(problem, StepTables.for_inputs(problem, inputs))
    assert plan.config.dedup == strategy.startswith("dedup")
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16)
    lse_t = torch.empty(kw["q"].shape[:2]) if lse else None
    signature = call_signature((kw["q"], kw["kv_cache"], out, lse_t), (layout, strategy))
    inputs = attrs.evolve(inputs, signature=signature)
    first = step_launches(plan.problem, inputs, plan.rows, out, lse_t, plan.config, plan.workspace, plan.memo)
    again = step_launches(plan.problem, inputs, plan.rows, out, lse_t, plan.config, plan.workspace, plan.memo)
    assert [k for k, _ in first] == [k for k, _ in again], "the second call must reuse the remembered kernels"
    for (kernel, args), (_, args_again) in zip(first, again, strict=True):
        names, defaults = kernel_parameters(kernel.fn)
        unknown = set(args) - set(names) - LAUNCH_OPTIONS
        assert not unknown, f"{kernel.fn.fn.__name__} takes no parameter(s) {sorted(unknown)}"
        assert set(args_again) == set(args), "first and later calls must pass the same parameters"
        for given in (args, args_again):
            values = bind_arguments(kernel.fn, given)  # raises on a parameter with no value
            assert len(values) == len(names)
            for name, value in zip(names, values, strict=True):
                expected = given[name] if name in given else defaults[name]
                assert value is expected, name
        for name in names:  # the later call's tensors are this call's, not remembered ones
            if isinstance(args.get(name), torch.Tensor):
                assert args_again[name] is args[name]


def test_a_missing_parameter_is_named() -> None:
    from msa.backends.triton.kernels import merge_kernel

    with pytest.raises(TypeError, match=r"merge_kernel: no value for parameter\(s\) part_o_ptr"):
        bind_arguments(merge_kernel, {})


@pytest.mark.parametrize("strategy", ["dedup", "split, in-kernel merge"])
def test_direct_launch_path_twice_under_the_interpreter(strategy: str, gen: torch.Generator,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct launcher's own binding, run: on a GPU the second call of a signature launches
    the compiled kernel with `bind_arguments`' values; here the interpreter runs the kernel with
    the same arguments (Triton's launch path), after the same binding, twice."""
    import msa.backends.triton as triton_backend

    monkeypatch.setattr(triton_backend, "direct_launch_enabled", lambda: True)
    kw, problem, inputs = _step("fp8_e4m3", False, False, False, gen)
    backend = TritonBackend(**STRATEGIES[strategy])
    plan = backend.plan(problem, StepTables.for_inputs(problem, inputs))
    signature = call_signature((kw["q"],), (strategy,))
    inputs = attrs.evolve(inputs, signature=signature)
    ref = None
    for _ in range(2):
        out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16)
        backend.run(plan, inputs, out, None)
        assert not out.isnan().any()
        ref = out if ref is None else ref
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
