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
