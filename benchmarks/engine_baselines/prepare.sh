#!/usr/bin/env bash
# Extract the serving engines' own MiniMax-M3 sparse decode kernels (vLLM 0.33.0, SGLang 0.5.23)
# from their wheels into .baselines/ at the repo root (git-ignored; never committed). Only the
# kernel files and the SGLang helpers they import are extracted (about 60 KB).
#
#   bash benchmarks/engine_baselines/prepare.sh            # wheels from $WHEEL_DIR (/work/wheels)
#   VLLM_WHEEL=... SGLANG_WHEEL=... bash .../prepare.sh    # explicit wheels
#
# Wheels not found are fetched with `pip download --no-deps` into $WHEEL_CACHE.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/.baselines"
wheel_dir="${WHEEL_DIR:-/work/wheels}"
cache="${WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/msa-engine-wheels}"
python="${PYTHON:-python3}"

find_wheel() {  # name version -> path of the wheel, downloading it if needed
    local w
    for dir in "$wheel_dir" "$cache"; do
        w="$(ls "$dir/$1-$2-"*.whl 2>/dev/null | head -n 1 || true)"
        if [ -n "$w" ]; then echo "$w"; return; fi
    done
    mkdir -p "$cache"
    "$python" -m pip download -q --no-deps --only-binary=:all: -d "$cache" "$1==$2" >&2
    ls "$cache/$1-$2-"*.whl | head -n 1
}

vllm_wheel="${VLLM_WHEEL:-$(find_wheel vllm 0.33.0)}"
sglang_wheel="${SGLANG_WHEEL:-$(find_wheel sglang 0.5.23)}"
sglang_ops=sglang/kernels/ops/attention/minimax_sparse

rm -rf "$dest/vllm" "$dest/sglang" "$dest/MANIFEST"  # (flashinfer_sm90.sh's folder beside them stays)
"$python" - "$dest" "$vllm_wheel" vllm/models/minimax_m3/common/ops/sparse_attn.py \
    "$sglang_wheel" "$sglang_ops/decode/topk_sparse.py" "$sglang_ops/common/tile_ptr.py" \
    "$sglang_ops/common/utils.py" <<'EOF'
import hashlib, os, sys, zipfile

dest, args, manifest = sys.argv[1], sys.argv[2:], []
wheel = None
for arg in args:
    if arg.endswith(".whl"):
        wheel = zipfile.ZipFile(arg)
        manifest.append(f"# {os.path.basename(arg)}")
        continue
    data = wheel.read(arg)
    path = os.path.join(dest, arg)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    manifest.append(f"{hashlib.sha256(data).hexdigest()}  {len(data):6d}  {arg}")
with open(os.path.join(dest, "MANIFEST"), "w") as f:
    f.write("\n".join(manifest) + "\n")
print("\n".join(manifest))
EOF
echo "extracted into $dest ($(du -sk "$dest" | cut -f1) KB)"
