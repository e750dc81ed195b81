"""Every Triton kernel on hostile inputs, for `compute-sanitizer`:

    compute-sanitizer --tool memcheck  python3 benchmarks/sanitize_triton.py [--seeds N]
    compute-sanitizer --tool initcheck python3 benchmarks/sanitize_triton.py --seeds 4

Steps come from the fuzz suite's generator (tests/hostile.py): -1 anywhere, ids past the visible
blocks and the table (+-2**31), negative pages and pages past the cache, empty, negative and
near-2**31 lengths, ragged offsets, every unread byte poisoned with NaN. Each runs through every
kernel path (per-token and dedup, fused and split, with and without the LSE) and must equal the
reference; then malformed `query_start_loc` (valid -> invalid -> valid: the last call must equal
the first) and the cache writers with slots past the cache and non-finite values. Nothing may be
read or written out of bounds, or read before it is written.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hostile import LAYOUTS, make_hostile  # type: ignore[import-not-found]  # noqa: E402

import msa  # noqa: E402
from msa.backends.triton import TritonBackend  # noqa: E402
from msa.validation import check_decode_inputs  # noqa: E402
from msa.workload import make_decode_step  # noqa: E402

STRATEGIES = list(itertools.product((1, 3), (False, True), (True, False)))  # splits, dedup, lse


def _params(rng: random.Random) -> dict[str, Any]:
    layout = rng.choice(LAYOUTS)
    return {
        "layout": layout, "batch": rng.randint(0, 4), "query_len": rng.randint(1, 4),
        "num_kv_heads": rng.choice([1, 2, 4]), "group": rng.choice([1, 4, 16]), "head_dim": rng.choice([64, 128]),
        "page_size": rng.choice([16, 64, 128]), "topk": rng.randint(1, 8), "max_blocks": rng.randint(1, 6),
        "ragged": rng.random() < 0.4, "token_major": rng.random() < 0.5, "tensor_scales": rng.random() < 0.5,
        "table_pad": rng.randint(0, 2), "q_fp8": rng.random() < 0.3 and layout != "float16",
    }


def _run(kw: dict[str, Any], backend: TritonBackend, with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    problem, inputs = check_decode_inputs(**kw, return_lse=with_lse)
    q = kw["q"]
    out = torch.full(q.shape, float("nan"), dtype=problem.out_dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), device=q.device) if with_lse else None
    backend.run_step(problem, inputs, out, lse)
    return out, lse


def _check(kw: dict[str, Any], out: torch.Tensor, lse: torch.Tensor | None, what: str) -> float:
    ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = (out.float() - ref_out.float()).abs().max().item() if out.numel() else 0.0
    assert err <= 5e-3 + 2**-7 * ref_out.float().abs().max().item() if out.numel() else True, f"{what}: error {err}"
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and not torch.isnan(lse).any(), f"{what}: LSE"
    return err


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def fuzzed(seeds: int) -> None:
    rng = random.Random(0)
    worst = 0.0
    for seed in range(seeds):
        hostile = make_hostile(_params(rng), seed, device=DEVICE)
        for splits, dedup, with_lse in STRATEGIES:
            out, lse = _run(hostile.kwargs, TritonBackend(num_splits=splits, dedup=dedup), with_lse)
            worst = max(worst, _check(hostile.kwargs, out, lse, f"{hostile} splits={splits} dedup={dedup}"))
    _sync()
    print(f"fuzzed: {seeds} hostile steps x {len(STRATEGIES)} kernel paths, max error {worst:.1e}")


def malformed_offsets() -> None:
    step = make_decode_step(msa.Geometry(16, 2, 128, 64, 4), batch_size=3, decode_query_len=4,
                                         context_len=400, kv_cache_dtype="fp8_e4m3", device=DEVICE, seed=3)
    kw = step.kwargs()
    kw["q"] = torch.randn((10, 16, 128), device=DEVICE).bfloat16()
    kw["topk_indices"] = kw["topk_indices"][:, :10]

    def with_starts(starts: list[int]) -> dict[str, Any]:
        return dict(kw, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE))

    for splits, dedup in itertools.product((1, 3), (False, True)):
        backend = TritonBackend(num_splits=splits, dedup=dedup)
        first, _ = _run(with_starts([0, 3, 7, 10]), backend, True)
        for bad in ([-2, 3, 4, 6], [0, 4, 8, 99], [0, 9, 3, 10], [5, 2, 12, 1]):
            out, lse = _run(with_starts(bad), backend, True)
            _check(with_starts(bad), out, lse, f"query_start_loc={bad} splits={splits} dedup={dedup}")
            again, _ = _run(with_starts([0, 3, 7, 10]), backend, True)
            assert torch.equal(again, first), f"spoiled by {bad} (splits={splits} dedup={dedup})"
    _sync()
    print("malformed query_start_loc: in bounds, equal to the reference, later calls unaffected")


def writers() -> None:
    for layout in ("bfloat16", "fp8_e4m3", "nvfp4"):
        lay = msa.get_layout(layout)
        cache = lay.allocate(8, 2, 64, 128, device=DEVICE)
        key = torch.randn(32, 2, 128, device=DEVICE).bfloat16()
        key[0, 0, 0], key[1, 1, 5] = float("inf"), float("nan")
        slots = torch.arange(32, device=DEVICE)
        slots[::3] = 2**40
        slots[1::4] = -7
        lay.write(cache, key, key, slots, kernel=True)
        lay.write(cache, key[:0], key[:0], slots[:0], kernel=True)
    _sync()
    print("writers: slots past the cache and negative ones skipped, non-finite inputs taken")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=24)
    parser.add_argument("--device", default="cuda", help="cpu runs the kernels under TRITON_INTERPRET=1")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    fuzzed(args.seeds)
    malformed_offsets()
    writers()
    print("sanitize run complete")


if __name__ == "__main__":
    main()
