"""Does the wgmma kernel's L2 eviction priority cost the kernels around it? (GPU with
`nvidia-cutlass-dsl`)

    PYTHONPATH=src:benchmarks python3 benchmarks/ab_evict_layers.py --tp 8 --batch 16 [--layers 8]
        [--neighbour-mb 24] [--evict last,normal,first] [--flush write|read] [--reps 30]

One step shape, `layers` caches of M3 at 64K (an engine's layers: each layer its own cache, pages
and lists). For each priority, two CUDA graphs, timed as replays after L2 is emptied (by writing
512 MB, the timer's way, or `--flush read`: by reading them, which leaves L2 clean):

- `decode`: the layers' decode steps back to back;
- `with neighbour`: each layer's step followed by a read of one `neighbour-mb` buffer that every
  layer reads again (what an engine keeps in L2 between its kernels: activations, norms, small
  weights). A priority that keeps the steps' pages in L2 ("last") may push that buffer out, and
  the neighbour reads then come from DRAM; one that lets them go first ("first") may help it.

Each layer's output is first checked against the reference (written over NaN). Prints us per
layer for both graphs and their difference (the buffer's reads, their launches and whatever they
cost the next step), beside a graph of the `layers` buffer reads alone (`reads alone`: their
cost with the buffer warm in L2 after the first, the floor of that difference)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_cute import add_flush_argument
from tune_kernels import checked_run, prepare_case

import msa
from msa.backends.cute import CuteBackend
from msa.bench.timing import Timer
from msa.display import format_table
from msa.workload import make_decode_step

TOLERANCE = 2e-2  # max abs error against the reference (outputs are O(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, choices=sorted(msa.MINIMAX_M3_TP), default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layout", default="fp8_e4m3")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--neighbour-mb", type=int, default=24)
    parser.add_argument("--evict", default="last,normal,first", help="comma-separated priorities, each timed twice")
    add_flush_argument(parser)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    timer = Timer(reps=args.reps, flush=args.flush)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for layer in range(args.layers):
        step = make_decode_step(msa.MINIMAX_M3_TP[args.tp], batch_size=args.batch, decode_query_len=1,
                                context_len=65536, kv_cache_dtype=args.layout, device="cuda", seed=layer)
        cases.append(prepare_case(step, args.batch, gen))
    neighbour = torch.empty(args.neighbour_mb * 2**20 // 8, dtype=torch.int64, device="cuda").fill_(1)

    def reads() -> None:
        for _ in range(args.layers):
            torch.sum(neighbour)

    floor = timer.graph(reads) / args.layers
    rows = []
    for evict in [e for _ in range(2) for e in args.evict.split(",")]:  # each priority twice, interleaved
        backend = CuteBackend(evict=evict)
        runs = []
        for _, ref, problem, inputs, tables, out in cases:
            _, run, err = checked_run(backend, problem, inputs, tables, out, ref)
            assert err <= TOLERANCE, f"evict {evict}: error {err:.2e} against the reference"
            runs.append(run)

        def decode(runs: list[Callable[[], object]] = runs) -> None:
            for run in runs:
                run()

        def with_neighbour(runs: list[Callable[[], object]] = runs) -> None:
            for run in runs:
                run()
                torch.sum(neighbour)

        alone = timer.graph(decode) / args.layers
        mixed = timer.graph(with_neighbour) / args.layers
        rows.append([evict, f"{alone:.2f}", f"{mixed:.2f}", f"{mixed - alone:.2f}", f"{floor:.2f}"])
        print(f"evict {evict}: decode {alone:.2f} us a layer, with neighbour {mixed:.2f}", flush=True)
    print(f"TP{args.tp} {args.layout} B={args.batch}, {args.layers} layers, neighbour {args.neighbour_mb} MB, "
          f"flush by {args.flush}, {torch.cuda.get_device_name()}")
    print(format_table(["evict", "decode us/layer", "with neighbour us/layer", "difference us/layer",
                        "reads alone us/layer"], rows))


if __name__ == "__main__":
    main()
