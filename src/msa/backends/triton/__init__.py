"""The `triton` backend: sparse decode over every layout (BF16/FP16 split, FP8 split, NVFP4 head
slots), any query length 1..32, any GQA group, head dims 64/128/256, power-of-two pages >= 16,
any top-k, natural-log LSE. Runs on CUDA GPUs (compute capability >= 8.0; below 8.9, which has no
E4M3 in hardware, fp8 bytes are decoded by bits: `LaunchConfig.soft_e4m3`), and on the CPU under
`TRITON_INTERPRET=1` when requested by name (for tests)."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from msa.backends.base import Backend
from msa.backends.capabilities import Capabilities
from msa.backends.triton.config import LaunchConfig, check_overrides, choose_config, dedup_supported, dedup_wanted
from msa.backends.triton.launch import LaunchMemo, Workspace, step_launches
from msa.launcher import direct_launch_enabled
from msa.planning import RowMetadata, StepTables
from msa.platform import Platform, detect, e4m3_in_hardware
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = ["TritonBackend", "TritonPlan"]


@attrs.frozen(eq=False)
class TritonPlan:
    """The launch configuration, the split-K workspace (sized at plan time) and the planner's
    per-row metadata the kernel reads."""

    problem: DecodeProblem
    config: LaunchConfig
    workspace: Workspace
    rows: RowMetadata
    memo: LaunchMemo = attrs.field(factory=LaunchMemo)


class TritonBackend(Backend[TritonPlan]):
    """Split-K (flash-decoding) Triton kernels over the selected pages, with in-kernel dequant."""

    name = "triton"
    description = "Triton kernels for every layout (CUDA; CPU under TRITON_INTERPRET=1)"
    capabilities = Capabilities(
        device_types=frozenset({"cuda", "cpu"}),
        min_capability=(8, 0),
        packages=("triton",),
        q_dtypes=frozenset({torch.bfloat16, torch.float16, torch.float8_e4m3fn}),
        head_dims=frozenset({64, 128, 256}),
        power_of_two_pages=True,
        query_lens=(1, 32),
        lse=True,
        ragged=True,
    )

    def __init__(self, **config_overrides: Any) -> None:
        """`config_overrides`: `choose_config`'s keyword arguments (`config.OVERRIDES`: dedup,
        num_splits, block_n, ...), each None or a value the kernels take (`MSAInputError`, naming
        the option, for anything else)."""
        check_overrides(config_overrides)
        self.config_overrides = config_overrides

    def machine_reasons(self, platform: Platform, *, requested: bool = False) -> list[str]:
        if platform.device_type == "cpu":
            if not platform.triton_interpret:
                return ["runs on the CPU only under TRITON_INTERPRET=1"]
            if not requested:
                return ["on the CPU it runs only through the Triton interpreter (slow): request it by name"]
        return []

    def extra_reasons(self, problem: DecodeProblem, platform: Platform, *, requested: bool = False) -> list[str]:
        if (self.config_overrides.get("soft_e4m3") is False and not e4m3_in_hardware(platform.capability)
                and _reads_e4m3(problem)):
            return [f"soft_e4m3=False: a GPU of compute capability {platform.capability} has no E4M3 in hardware "
                    "(Triton cannot compile it there); leave soft_e4m3 None or True"]
        return []

    def config_for(self, problem: DecodeProblem, device: torch.device) -> LaunchConfig:
        """The launch configuration for `problem`. `MSA_TRITON_DEDUP=1` / `0` forces the dedup /
        per-token strategy for multi-token steps (constructor overrides win)."""
        return self._config(problem, detect(device))

    def strategy(self, problem: DecodeProblem, platform: Platform) -> str | None:
        config = self._config(problem, platform)
        if config.dedup:
            kernel = f"the dedup kernel ({config.tokens} tokens of a request per program, each page read once)"
        else:
            kernel = "the per-token kernel"
            if problem.query_len > 1 and problem.dcp_size > 1 and dedup_supported(
                    problem.geometry, problem.layout, problem.query_len):
                kernel += f" (not dedup: a rank of {problem.dcp_size} holds a share of each selection)"
        merge = ("one pass" if config.num_splits == 1 else
                 f"{config.num_splits} splits merged {'in the kernel' if config.in_kernel_merge else 'by a kernel'}")
        e4m3 = ", E4M3 decoded by bits (no E4M3 in hardware)" if config.soft_e4m3 and _reads_e4m3(problem) else ""
        return f"{kernel}, {merge}, {config.block_n}-token tiles{e4m3}"

    def _config(self, problem: DecodeProblem, platform: Platform) -> LaunchConfig:
        overrides = dict(self.config_overrides)
        wanted = dedup_wanted()
        if wanted is not None and "dedup" not in overrides:
            overrides["dedup"] = wanted
        return choose_config(
            problem.geometry,
            problem.num_rows,
            platform.sm_count,
            layout=problem.layout,
            batch_size=problem.batch_size,
            query_len=problem.query_len,
            dcp_size=problem.dcp_size,
            capability=platform.capability,
            **overrides,
        )

    def plan(self, problem: DecodeProblem, tables: StepTables) -> TritonPlan:
        device = tables.seq_lens.device
        config = self.config_for(problem, device)
        return TritonPlan(problem, config, Workspace(problem, config, device), tables.rows)

    def run(self, plan: TritonPlan, inputs: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """Launch the step's kernels (the decode, and the merge when split unless the kernel merges)
        into `out` / `lse`. Allocates nothing and never synchronises: every buffer is the caller's
        or the plan's. A call with a call signature launches directly after its first time."""
        if plan.problem.num_rows == 0:
            return
        direct = inputs.signature is not None and direct_launch_enabled()
        for kernel, args in step_launches(plan.problem, inputs, plan.rows, out, lse, plan.config, plan.workspace,
                                          plan.memo):
            kernel(args, direct)


def _reads_e4m3(problem: DecodeProblem) -> bool:
    """Whether a step reads E4M3 bytes: an fp8 or NVFP4 cache (its block scales), or an fp8 query."""
    return problem.layout.quantized or problem.q_dtype == torch.float8_e4m3fn
