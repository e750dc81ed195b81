"""Why `tests/test_sglang.py::test_drop_in_on_gpu[bfloat16]` failed one run in a few (H200).

For 120 seeds the drop-in's step is compared with the reference at the test's old tolerance
(rtol 2^-6, atol 3e-3); each failing seed is run 4 more times (a race would move the error), and
every launch form is tried: `auto`, Triton's binder instead of direct launches, a split-K step
merged by the merge kernel, one fused pass, split-K merged in the kernel.

    PYTHONPATH=src:tests python3 benchmarks/diagnose_sglang_tolerance.py   # writes $OUT/diag_sglang.json

Recorded (2026-12-02, H200): 17-21 of 120 seeds fail in every form, each failing seed on all 4
repeats, worst error 0.031 (one element 2^-6 off): deterministic, the bf16 rounding of the softmax
weights (up to 2^-9 max|V|, with V = 2 N(0,1)), not a race -> `cases.gpu_atol`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import gpu_check  # type: ignore[import-not-found]  # noqa: E402
import test_sglang  # type: ignore[import-not-found]  # noqa: E402

import msa.registry  # noqa: E402
from msa.registry import BackendRegistry  # noqa: E402

RTOL, ATOL = 2**-6, 3e-3
VARIANTS = [("auto", {}), ("direct-off", {"MSA_TRITON_DIRECT_LAUNCH": "0"}),
            ("split-merge-kernel", {"MSA_BACKEND": "gate-split"}), ("fused", {"MSA_BACKEND": "gate-fused"}),
            ("merge-in-kernel", {"MSA_BACKEND": "gate-merge-in-kernel"})]


def once(seed: int) -> tuple[float, float, dict[str, Any], torch.Tensor, torch.Tensor]:
    gen = torch.Generator()
    gen.manual_seed(seed)
    s = test_sglang._sglang_state(gen, "bfloat16", page_size=128, batch=16, device="cuda")
    out, ref = test_sglang._drop_in(s).float(), test_sglang._reference(s).float()
    excess = (out - ref).abs() - (ATOL + RTOL * ref.abs())
    return float(excess.max()), float((out - ref).abs().max()), s, out, ref


def main() -> None:
    msa.registry.reset_registry(BackendRegistry(plugins=[("gpu-check", gpu_check._GatePlugin())]))
    report = {}
    for variant, env in VARIANTS:
        for key in ("MSA_TRITON_DIRECT_LAUNCH", "MSA_BACKEND"):
            os.environ.pop(key, None)
        os.environ.update(env)
        fails, worst, start = [], 0.0, time.time()
        for seed in range(120):
            excess, err, s, out, ref = once(seed)
            worst = max(worst, err)
            if excess > 0:
                again = [once(seed)[0] > 0 for _ in range(4)]
                bad = ((out - ref).abs() > (ATOL + RTOL * ref.abs())).nonzero()
                rows = sorted(set(bad[:, 0].tolist()))
                fails.append(dict(seed=seed, max_err=err, repeat_fails=sum(again), rows=rows[:8],
                                  lens=[int(s["seq_lens"][r]) for r in rows[:8]], nbad=int(bad.shape[0])))
        seconds = round(time.time() - start, 1)
        report[variant] = dict(failures=len(fails), worst=worst, detail=fails[:6], seconds=seconds)
        print(variant, len(fails), "of 120 failed; worst abs err", round(worst, 4), fails[:2], flush=True)
    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "diag_sglang.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
