"""The GPU gate (`make gpu-check`): every kernel path on the GPU, called as engines call it.

Part 1, the path matrix: every layout and cache form (bf16, fp8: packed and separate; NVFP4) x
strategy (`auto` as it chooses, and forced: one fused pass, split-K merged by the merge kernel,
split-K merged in the kernel, the dedup kernel, the E4M3 decode by bits of GPUs below compute
capability 8.9, `cute`) x L (1, 2, 4) x B (1, 16, 64), at
MiniMax-M3 TP1 heads, and on Hopper the forced cute shapes of `FORCED_CUTE`. Each case is

- called twice eagerly through `msa.sparse_decode` (the first call checks and compiles, the
  second takes the remembered call signature and the direct launches), on two different steps;
- then planned with a `DecodePlanner`, captured in a CUDA graph once, and replayed three times,
  each time after a fresh step was written into the captured tensors in place;

and every result is compared with the reference backend, with NaN (or E4M3 NaN bytes, or wild
block-table entries) in every byte the contract says is never read: -1 anywhere in the lists,
ids past the visible blocks, padded requests, query heads of rows that see nothing.

Part 2: the whole `-m gpu` pytest suite, then the tests that have been flaky again, repeated with
fresh seeds.

The record (`--record FILE`) starts with `src <tree hash>`: the git tree hash of the `src/` it
ran on, computed from the files (so a copy without `.git` computes it too; it equals
`git rev-parse HEAD:src` when `src/` is committed), then the summary line and every failure.

    PYTHONPATH=src:tests python3 tests/gpu_check.py --record benchmarks/results/gpu-check.txt
    PYTHONPATH=src:tests TRITON_INTERPRET=1 python3 tests/gpu_check.py --smoke   # the CPU self-test
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from cases import gpu_atol

import msa
import msa.registry
from msa.backends.cute import CuteBackend
from msa.backends.triton import TritonBackend
from msa.registry import BackendRecord, BackendRegistry, hookimpl
from msa.workload import DecodeStep, make_decode_step

ROOT = Path(__file__).resolve().parents[1]
INT32_MIN = -(2**31)

#: name -> TritonBackend overrides of each forced Triton strategy (registered as backends of their
#: own below every built-in, so `auto` never picks them)
FORCED: dict[str, dict[str, Any]] = {
    "gate-fused": dict(num_splits=1, dedup=False),
    "gate-split": dict(num_splits=4, dedup=False, in_kernel_merge=False),
    "gate-merge-in-kernel": dict(num_splits=2, dedup=False, in_kernel_merge=True),
    "gate-dedup": dict(dedup=True),
    # the E4M3 decode by bits of GPUs below compute capability 8.9 (`LaunchConfig.soft_e4m3`)
    "gate-e4m3-bits": dict(soft_e4m3=True),
}
#: name -> CuteBackend options of each forced cute strategy (registered like `FORCED`'s), and the
#: steps it takes (layout, batch) at L = 1: two half walks of M3 TP1 B = 40 (160 programs on 132
#: SMs), the shape `auto` gives NVFP4 there and fp8 on an H200, on whichever Hopper the gate runs
FORCED_CUTE: dict[str, dict[str, Any]] = {"gate-cute-halves": dict(kernel="wgmma", num_splits=2, stages=2, vreg=True)}
FORCED_CUTE_STEPS = (("fp8_e4m3", 40), ("nvfp4", 40))
#: layout, cache form
CACHES = (("bfloat16", "packed"), ("bfloat16", "separate"), ("fp8_e4m3", "packed"), ("fp8_e4m3", "separate"),
          ("nvfp4", "packed"))
#: the tests that failed intermittently before; repeated with fresh seeds
FLAKY_PRONE = (
    "tests/test_sglang.py::test_drop_in_on_gpu",
    "tests/test_threads.py",
    "tests/test_planner.py::test_graph_capture_and_replay",
    "tests/test_triton.py::test_in_kernel_merge_replays_in_a_cuda_graph",
    "tests/test_triton.py::test_triton_edge_cases_on_gpu",
)
#: out within 2^-6 relative plus `cases.gpu_atol` (the softmax weights' rounding, from the step's
#: values); LSE within 1e-4 relative plus 1e-3
OUT_RTOL, LSE_RTOL, LSE_ATOL = 2**-6, 1e-4, 1e-3


def src_tree_hash(src: Path) -> str:
    """The git tree hash of `src` from its files (what `git rev-parse HEAD:src` gives when the
    files are committed; `__pycache__`, `*.pyc` and `*.egg-info` left out, as .gitignore does)."""

    def tree(path: Path) -> str:
        entries = []
        for child in path.iterdir():
            if child.name == "__pycache__" or child.suffix == ".pyc" or child.name.endswith(".egg-info"):
                continue
            if child.is_dir():
                entries.append((child.name + "/", b"40000", child.name, bytes.fromhex(tree(child))))
            else:
                data = child.read_bytes()
                blob = hashlib.sha1(b"blob %d\0" % len(data) + data).digest()
                mode = b"100755" if os.access(child, os.X_OK) else b"100644"
                entries.append((child.name, mode, child.name, blob))
        body = b"".join(mode + b" " + name.encode() + b"\0" + digest for _, mode, name, digest in sorted(entries))
        return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()

    return tree(src)


class _GatePlugin:
    """The forced strategies as backends (priority below every built-in)."""

    @hookimpl
    def msa_backends(self) -> list[BackendRecord]:
        records = []
        for base, forced in ((TritonBackend, FORCED), (CuteBackend, FORCED_CUTE)):
            for name, overrides in forced.items():
                cls = type(name.replace("-", "_"), (base,), {"name": name})

                def factory(cls: type[Any] = cls, overrides: dict[str, Any] = overrides) -> Any:
                    return cls(**overrides)

                records.append(BackendRecord(name=name, factory=factory, priority=-1000,
                                             description=f"gpu-check: {base.name} with {overrides}"))
        return records


# -- steps, poisoned ---------------------------------------------------------------------------

def _malform(step: DecodeStep, gen: torch.Generator) -> None:
    """Lists and lengths with what the contract skips: -1 anywhere (10%), ids past the visible
    blocks (5%), a padded request (seq_len 0) when B >= 4."""
    topk = step.topk_indices
    noise = torch.rand(topk.shape, generator=gen, device=topk.device)
    topk[noise < 0.10] = -1
    past = step.block_table.shape[1] + 3
    topk[(noise >= 0.10) & (noise < 0.15)] = past
    if step.seq_lens.shape[0] >= 4:
        step.seq_lens[1] = 0


def _read_sets(step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a backend may read: cache tokens `[pages, Hkv, P]`, block-table entries `[B, cols]`,
    and the (row, KV head) pairs that attend something `[R, Hkv]` — from the semantics, row by
    row, on the device."""
    g, L = step.geometry, step.decode_query_len
    table, lens, topk = step.block_table, step.seq_lens.long(), step.topk_indices.long()  # topk [Hkv, R, K]
    hkv, rows, _ = topk.shape
    p, cols = g.page_size, table.shape[1]
    num_pages = _num_pages(step)
    request = torch.arange(rows, device=table.device) // L
    n = (lens[request] - L + torch.arange(rows, device=table.device) % L + 1).clamp(min=0)  # [R]
    limit = ((n + p - 1) // p).clamp(max=cols).view(1, -1, 1)
    used = (topk >= 0) & (topk < limit)
    j = topk.clamp(min=0, max=cols - 1)
    page = table.long()[request.view(1, -1, 1), j]
    read_table = torch.zeros(table.shape, dtype=torch.bool, device=table.device)
    read_table[request.view(1, -1, 1).expand_as(j)[used], j[used]] = True
    used &= (page >= 0) & (page < num_pages)
    o = torch.arange(p, device=table.device).view(1, 1, 1, -1)
    visible = used.unsqueeze(-1) & (o < (n.view(1, -1, 1, 1) - j.unsqueeze(-1) * p))
    head = torch.arange(hkv, device=table.device).view(-1, 1, 1, 1).expand_as(visible)
    read = torch.zeros((num_pages, hkv, p), dtype=torch.bool, device=table.device)
    read[page.unsqueeze(-1).expand_as(visible)[visible], head[visible], o.expand_as(visible)[visible]] = True
    attends = visible.any(dim=-1).any(dim=-1).transpose(0, 1)  # [R, Hkv]
    return read, read_table, attends


def _num_pages(step: DecodeStep) -> int:
    cache = step.kv_cache[0] if isinstance(step.kv_cache, tuple) else step.kv_cache
    return int(cache.shape[0])


def _poison(step: DecodeStep, gen: torch.Generator) -> None:
    """NaN into every unread byte: cache tokens (K and V; NVFP4 block scales), block-table
    entries (wild page ids), query heads of (row, KV head) pairs that attend nothing."""
    read, read_table, attends = _read_sets(step)
    unread = ~read
    name = step.layout.name
    if name == "nvfp4":
        slots = step.kv_cache
        assert isinstance(slots, torch.Tensor)
        pages, _, p, width = slots.shape
        d = step.geometry.head_dim
        groups = d // 16
        flat = slots.view(pages, slots.shape[1], p * width)
        page, head, token = unread.nonzero(as_tuple=True)
        g = torch.arange(groups, device=slots.device).view(1, -1)
        t = token.view(-1, 1)
        for side in (0, 1):
            pos = t * groups + g if side == 0 else (t // 4) * (4 * groups) + g * 4 + t % 4
            flat[page.view(-1, 1), (2 * head + side).view(-1, 1), p * d // 2 + pos] = 0x7F  # e4m3 NaN scales
    else:
        tensors = step.kv_cache if isinstance(step.kv_cache, tuple) else (step.kv_cache,)
        for t in tensors:
            if t.dtype == torch.float8_e4m3fn:
                t.view(torch.uint8)[unread] = 0x7F
            else:
                t[unread] = float("nan")
    wild = torch.tensor([-1, INT32_MIN, _num_pages(step), _num_pages(step) + 1000], dtype=torch.int32,
                        device=step.block_table.device)
    pick = torch.randint(len(wild), step.block_table.shape, generator=gen, device=step.block_table.device)
    step.block_table.copy_(torch.where(read_table, step.block_table, wild[pick]))
    heads = (~attends).repeat_interleave(step.geometry.group_size, dim=1)  # [R, Hq]
    step.q[heads] = float("nan")


def _step(layout: str, form: str, batch: int, length: int, device: str, geometry: msa.Geometry,
          context: int, seed: int) -> DecodeStep:
    step = make_decode_step(geometry, batch_size=batch, decode_query_len=length, context_len=context,
                            kv_cache_dtype=layout, device=device, seed=seed, kv_form=form)
    step = attrs.evolve(step, topk_indices=step.topk_indices.clone())  # a buffer of our own, written in place
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    _malform(step, gen)
    _poison(step, gen)
    return step


def _write_into(dst: DecodeStep, src: DecodeStep) -> None:
    """`src`'s data into `dst`'s tensors, in place (a captured graph reads `dst`'s)."""
    for a, b in ((dst.q, src.q), (dst.topk_indices, src.topk_indices), (dst.block_table, src.block_table),
                 (dst.seq_lens, src.seq_lens), (dst.k_scale, src.k_scale), (dst.v_scale, src.v_scale)):
        a.copy_(b)
    caches = zip(dst.kv_cache if isinstance(dst.kv_cache, tuple) else (dst.kv_cache,),
                 src.kv_cache if isinstance(src.kv_cache, tuple) else (src.kv_cache,), strict=True)
    for a, b in caches:
        a.copy_(b)


# -- checks ------------------------------------------------------------------------------------

def _compare(step: DecodeStep, out: torch.Tensor, lse: torch.Tensor | None, where: str) -> None:
    ref_out, ref_lse = msa.sparse_decode(**step.kwargs(), backend="reference", return_lse=True)
    if torch.isnan(out).any() or (lse is not None and torch.isnan(lse).any()):
        raise AssertionError(f"{where}: NaN in the output (an unread byte was read, or an element never written)")
    empty = torch.isneginf(ref_lse)
    if not (out[empty] == 0).all():
        raise AssertionError(f"{where}: a row that attends nothing is not 0")
    atol = gpu_atol(step.kwargs())
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=OUT_RTOL, atol=atol, msg=lambda m: f"{where}: {m}")
    if lse is None:
        return
    if not torch.equal(torch.isneginf(lse), empty):
        raise AssertionError(f"{where}: rows with an LSE of -inf differ from the reference's")
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=LSE_RTOL, atol=LSE_ATOL,
                               msg=lambda m: f"{where}: LSE {m}")


def _cases(smoke: bool, cute: bool, hopper: bool = False) -> Iterator[tuple[str, str, str, int, int]]:
    strategies = ["auto", *FORCED]
    if cute:
        strategies.append("cute")
    batches, lengths = ((1, 4), (1, 2)) if smoke else ((1, 16, 64), (1, 2, 4))
    for (layout, form), strategy, length, batch in itertools.product(CACHES, strategies, lengths, batches):
        if strategy == "gate-dedup" and length == 1:
            continue  # one token per request: nothing to share
        if strategy == "gate-e4m3-bits" and layout == "bfloat16":
            continue  # no E4M3 byte to decode
        if strategy == "cute" and (form != "packed" or (layout == "bfloat16" and not hopper)):
            continue  # cute's paths: packed caches (bf16 on its wgmma kernel only: compute capability 9.x)
        yield layout, form, strategy, length, batch
    if hopper:  # the forced cute shapes (the wgmma kernel's), beside what `auto` and `cute` choose there
        for (layout, batch), strategy in itertools.product(FORCED_CUTE_STEPS, ["auto", "cute", *FORCED_CUTE]):
            yield layout, "packed", strategy, 1, batch


def run_case(layout: str, form: str, strategy: str, length: int, batch: int, *, device: str,
             geometry: msa.Geometry, context: int, seed: int, graphs: bool) -> None:
    where = f"{layout}/{form} {strategy} L={length} B={batch} seed={seed}"
    lse_on = (batch + length) % 2 == 0  # half the cases without the LSE output
    steps = [_step(layout, form, batch, length, device, geometry, context, seed + i) for i in range(2)]
    for i, step in enumerate(steps):  # twice eagerly: the second call takes the remembered signature
        out = torch.full(step.q.shape, float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full(step.q.shape[:2], float("nan"), device=device) if lse_on else None
        msa.sparse_decode(**step.kwargs(), backend=strategy, out=out, lse=lse)
        _compare(step, out, lse, f"{where} eager call {i + 1}")
    if not graphs:
        return
    step = steps[0]
    planner = msa.DecodePlanner(geometry, kv_cache_dtype=layout, backend=strategy, device=device, with_lse=True,
                                kv_form=form, graph_capture=True)
    plan = planner.plan(step.block_table, step.seq_lens, decode_query_len=length)
    out = torch.empty(step.q.shape, dtype=torch.bfloat16, device=device)
    lse = torch.empty(step.q.shape[:2], device=device)
    kw = dict(out=out, lse=lse, k_scale=step.k_scale, v_scale=step.v_scale)
    planner.run(plan, step.q, step.kv_cache, step.topk_indices, **kw)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planner.run(plan, step.q, step.kv_cache, step.topk_indices, **kw)
    for r in range(3):
        fresh = _step(layout, form, batch, length, device, geometry, context, seed + 10 + r)
        _write_into(step, fresh)
        if planner.plan(step.block_table, step.seq_lens, decode_query_len=length) is not plan:
            raise AssertionError(f"{where}: plan() returned another plan for the captured shape")
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        _compare(step, out, lse, f"{where} graph replay {r + 1}")


def path_matrix(smoke: bool, report: Callable[[str], None], only: int | None = None) -> tuple[int, list[str]]:
    """Part 1; returns (cases run, failures)."""
    from msa.platform import package_installed

    device = "cpu" if smoke else "cuda"
    cute = not smoke and package_installed("cutlass_dsl") and torch.cuda.get_device_capability() >= (9, 0)
    hopper = cute and torch.cuda.get_device_capability()[0] == 9
    geometry = msa.Geometry(8, 2, 64, 16, 4) if smoke else msa.MINIMAX_M3
    context = 100 if smoke else 4096
    previous = msa.registry.reset_registry(BackendRegistry(plugins=[("gpu-check", _GatePlugin())]))
    failures, count = [], 0
    cases = list(_cases(smoke, cute, hopper))[:only]
    start = time.monotonic()
    try:
        for n, case in enumerate(cases):
            count += 1
            try:
                run_case(*case, device=device, geometry=geometry, context=context, seed=1000 * n + 7,
                         graphs=not smoke)
            except Exception as exc:  # every failure is recorded, the gate goes on
                failures.append(f"{' '.join(map(str, case))}: {type(exc).__name__}: {str(exc)[:400]}")
                report(f"FAIL {failures[-1]}")
                report(traceback.format_exc(limit=3))
            if n % 20 == 19 or n == len(cases) - 1:
                report(f"  paths: {n + 1}/{len(cases)} cases, {len(failures)} failed, {time.monotonic() - start:.0f} s")
    finally:
        msa.registry.reset_registry(previous)
    if not cute and not smoke:
        failures.append("cute: not run (nvidia-cutlass-dsl missing or compute capability < 9.0)")
    return count, failures


def start_pytest_suite(repeats: int) -> list[tuple[str, subprocess.Popen[str]]]:
    """Part 2, started beside part 1 (a correctness gate: the GPU is shared, nothing is timed):
    the `-m gpu` suite once, and the flaky-prone tests `repeats` times with fresh seeds, each
    spread over a few processes where pytest-xdist is installed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))
    try:
        import xdist  # noqa: F401

        spread = ["-n", "3"]
    except ImportError:
        spread = []
    runs = []
    for name, args in (("pytest -m gpu", ["tests"]),
                       (f"flaky-prone x{repeats}", ["--keep-duplicates", *FLAKY_PRONE * repeats])):
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "-m", "gpu", *spread, *args]
        runs.append((name, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)))
    return runs


def finish_pytest_suite(runs: list[tuple[str, subprocess.Popen[str]]], report: Callable[[str], None]) -> tuple[
        list[str], list[str], bool]:
    """Each run's last line ('N passed ...') and its FAILED lines, and whether all passed."""
    lines, failed, ok = [], [], True
    for name, proc in runs:
        output, _ = proc.communicate()
        tail = [line for line in output.splitlines() if line.strip()][-25:]
        report(f"--- {name}:\n" + "\n".join(tail))
        lines.append(f"{name}: {tail[-1] if tail else f'exit {proc.returncode}'}")
        failed += [line for line in output.splitlines() if line.startswith("FAILED")]
        ok &= proc.returncode == 0
    return lines, failed, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", type=Path, default=None, help="write the record here (first line: src <hash>)")
    parser.add_argument("--smoke", action="store_true", help="a small CPU run of the path matrix (interpreter)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the flaky-prone tests after the suite")
    parser.add_argument("--no-suite", action="store_true", help="the path matrix only")
    parser.add_argument("--only", type=int, default=None, help="the first N cases of the path matrix (a quick look)")
    args = parser.parse_args(argv)

    def report(line: str) -> None:
        print(line, flush=True)

    start = time.monotonic()
    tree = src_tree_hash(ROOT / "src")
    runs = [] if args.smoke or args.no_suite else start_pytest_suite(args.repeats)
    count, failures = path_matrix(args.smoke, report, args.only)
    suite, suite_failed, suite_ok = finish_pytest_suite(runs, report) if runs else (["pytest: not run"], [], True)
    passed = not failures and suite_ok
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    summary = (f"gpu-check {'PASSED' if passed else 'FAILED'}: paths {count - len(failures)}/{count} "
               f"(each 2 eager calls + 3 graph replays); {'; '.join(suite)}; {device}; "
               f"{time.monotonic() - start:.0f} s")
    report(summary)
    if args.record is not None:
        body = [f"src {tree}", summary, *(f"failure: {f}" for f in failures + suite_failed)]
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text("\n".join(body) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
