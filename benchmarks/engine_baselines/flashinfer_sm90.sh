#!/usr/bin/env bash
# Fetch FlashInfer's Hopper (SM90) MiniMax-M3 sparse decode kernel (one CuTe DSL file, newer than
# any FlashInfer release) into .baselines/flashinfer_sm90/ at the repo root (git-ignored; never
# committed), pinned to a commit and checked by its sha256. benchmarks/flashinfer_sm90.py imports it.
#
#   bash benchmarks/engine_baselines/flashinfer_sm90.sh            # from GitHub (curl)
#   FLASHINFER_SM90_FILE=path bash .../flashinfer_sm90.sh          # a copy obtained another way
set -euo pipefail

commit=2fbac56973d66894f1c3732ee3f68b0773dea768
path=flashinfer/msa_ops/cute_dsl/sparse_decode_sm90.py
sha=f84a130bc5fe2d7a2f1839cf0ef00571b144a52433b4571fccac6a3f1e74ee94

root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/.baselines/flashinfer_sm90"
mkdir -p "$dest"
if [ -n "${FLASHINFER_SM90_FILE:-}" ]; then
    cp "$FLASHINFER_SM90_FILE" "$dest/sparse_decode_sm90.py.new"
else
    curl -fsSL "https://raw.githubusercontent.com/flashinfer-ai/flashinfer/$commit/$path" -o "$dest/sparse_decode_sm90.py.new"
fi
got="$(sha256sum "$dest/sparse_decode_sm90.py.new" | cut -d' ' -f1)"
if [ "$got" != "$sha" ]; then
    echo "error: $path at $commit has sha256 $got, expected $sha" >&2
    rm -f "$dest/sparse_decode_sm90.py.new"
    exit 1
fi
mv "$dest/sparse_decode_sm90.py.new" "$dest/sparse_decode_sm90.py"
echo "flashinfer-ai/flashinfer $path $commit" > "$dest/SOURCE.txt"
echo "fetched into $dest"
