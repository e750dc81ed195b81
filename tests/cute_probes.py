"""Small CuTe DSL kernels that run one `msa.backends.cute.ptx` helper on the GPU, for
tests/test_cute.py (import only where `nvidia-cutlass-dsl` is installed). This module does not
postpone its annotations: the DSL reads a kernel's annotations as its argument types."""

from typing import Any


def warp_rank_host() -> Any:
    """A `@cute.jit` host function `(src, dst)` (device addresses of 32 int32 each) whose one warp
    writes `ptx.warp_rank_i32` of key `src[lane]` to `dst[lane]`."""
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    from msa.backends.cute import ptx

    @cute.kernel
    def rank_kernel(src: Int64, dst: Int64) -> None:
        lane = cute.arch.lane_idx()
        key = ptx.ld_b32_plain(src + Int64(lane) * 4, Int32(1))
        ptx.st_b32(dst + Int64(lane) * 4, ptx.warp_rank_i32(key), Int32(1))

    @cute.jit
    def host(src: Int64, dst: Int64) -> None:
        rank_kernel(src, dst).launch(grid=[1, 1, 1], block=[32, 1, 1])

    return host


def weights_store_host(nc: int, wgs: int, kreg: bool) -> Any:
    """A `@cute.jit` host function `(base)` (a shared address, int32) whose `wgs` warpgroups each
    store a tile's weights as the wgmma kernel does (`sm90.store_weights` at `sm90.weights_row_at`,
    a thread's weights in the order of `sm90.score_mma(kreg, nc)`'s accumulator), weight e of
    every thread being e + 1: compiled, not run (tests replay its PTX)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from msa.backends.cute import sm90

    @cute.kernel
    def store_kernel(mma: cute.TiledMma, base: Int32) -> None:
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        ns = cute.size(mma.get_slice(tid % 128).partition_C(cute.make_identity_tensor((sm90.TILE, nc))))
        pk = cute.make_rmem_tensor(cute.make_layout(ns), Float32)
        for e in cutlass.range_constexpr(ns):
            pk[e] = Float32(e + 1)
        sm90.store_weights(sm90.weights_row_at(base, tid // 128, nc, tid % 32, warp % 4), pk, ns)

    @cute.jit
    def host(base: Int32) -> None:
        store_kernel(sm90.score_mma(kreg, nc), base).launch(grid=[1, 1, 1], block=[128 * wgs, 1, 1])

    return host
