#!/usr/bin/env bash
# Pack the CuTe DSL (nvidia-cutlass-dsl 4.8.1, CUDA 12 libraries, cp312 x86-64) for a GPU machine
# that cannot reach a package index, as one xz archive small enough to carry (~52 MiB: the
# wheels unpacked, BCJ-filtered, one thread so the dictionary spans the 190 MB library), plus the
# script that unpacks it there:
#
#   bash benchmarks/carry_dsl.sh [DIR]        # here (needs pip and xz): DIR/site.tar.xz, DIR/setup.sh (default .dsl)
#   source DIR/setup.sh                       # there, from the repo root: the DSL, src, benchmarks and
#                                             # tests on PYTHONPATH (unpacked into /tmp/site once)
set -euo pipefail

dest="${1:-.dsl}"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for name in nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-core; do
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$work/whl" "$name==4.8.1"
done
mkdir -p "$work/site" "$dest"
for w in "$work"/whl/*.whl; do (cd "$work/site" && unzip -q -o "$w"); done
rm -rf "$work/site/nvidia_cutlass_dsl/cu12/lib/stubs"  # (QNX stubs)
tar -C "$work" -c site | xz -T1 --x86 --lzma2=preset=9e,dict=256MiB > "$dest/site.tar.xz"
cat > "$dest/setup.sh" <<SETUP
# source me from the repo root on the GPU machine
if [ ! -d /tmp/site/nvidia_cutlass_dsl ]; then tar -xJf $dest/site.tar.xz -C /tmp; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:\$PWD/src:\$PWD/benchmarks:\$PWD/tests
export PYTHONUNBUFFERED=1
SETUP
ls -la "$dest"
