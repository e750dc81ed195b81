"""Install what the conformance tests need beside msa's own environment (`make conformance`).

Downloads the pinned wheels once into a cache directory (vLLM's is ~336 MB) and reuses them, then
lays out a directory for `PYTHONPATH`:

- FlashInfer 0.7.2.post1 (`pip install --no-deps`) and the few packages `flashinfer.msa_ops`
  imports (apache-tvm-ffi, requests, tqdm, nvidia-ml-py);
- vLLM 0.33.0's Python files and the `fmha_sm100` binding templates, unpacked from its wheel
  (`vllm` imports without its compiled extension or its dependencies; the conformance tests use
  `vllm.third_party.fmha_sm100` alone), with its metadata so its version is known.

Nothing is installed into the environment itself, and nothing here needs a GPU, a CUDA toolkit or
nvidia-cutlass-dsl.

    python tests/conformance/install.py --wheels .cache/wheels --site .cache/conformance/site
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PINS = {"vllm": "0.33.0", "flashinfer-python": "0.7.2.post1"}
#: What `import flashinfer.msa_ops` needs beyond torch, numpy, packaging and jinja2.
FLASHINFER_IMPORTS = ("apache-tvm-ffi==0.1.11", "requests", "tqdm", "nvidia-ml-py")
#: Any platform's wheel will do: only Python files and templates are used.
WHEEL_PLATFORM = ("--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
                  "--implementation", "cp")
MARKER = ".conformance-installed"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def wheel(wheels: Path, name: str, version: str) -> Path:
    """The pinned wheel, downloaded into `wheels` unless it is there already."""
    stem = name.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if not found:
        print(f"conformance: downloading {name}=={version} into {wheels}", flush=True)
        _pip("download", "-q", "--no-deps", *WHEEL_PLATFORM, "-d", str(wheels), f"{name}=={version}")
        found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise SystemExit(f"conformance: no wheel of {name}=={version} in {wheels}")
    return found[0]


def unpack_vllm(path: Path, site: Path) -> None:
    """vLLM's Python files, fmha_sm100's binding templates and the distribution metadata."""
    with zipfile.ZipFile(path) as archive:
        names = [
            n for n in archive.namelist()
            if (n.startswith("vllm/") and n.endswith(".py"))
            or (n.startswith("vllm/third_party/fmha_sm100/csrc/") and n.endswith(".jinja"))
            or (n.startswith("vllm-") and ".dist-info/" in n)
        ]
        archive.extractall(site, names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, required=True, help="where the pinned wheels are cached")
    parser.add_argument("--site", type=Path, required=True, help="the directory to lay out (for PYTHONPATH)")
    args = parser.parse_args()
    args.wheels.mkdir(parents=True, exist_ok=True)
    wanted = " ".join(f"{n}=={v}" for n, v in PINS.items())
    marker = args.site / MARKER
    if marker.is_file() and marker.read_text().strip() == wanted:
        marker.touch()
        print(f"conformance: {wanted} already in {args.site}")
        return
    vllm = wheel(args.wheels, "vllm", PINS["vllm"])
    flashinfer = wheel(args.wheels, "flashinfer-python", PINS["flashinfer-python"])
    shutil.rmtree(args.site, ignore_errors=True)
    args.site.mkdir(parents=True)
    print(f"conformance: installing into {args.site}", flush=True)
    _pip("install", "-q", "--no-compile", "--no-deps", "--target", str(args.site), str(flashinfer))
    _pip("install", "-q", "--no-compile", "--upgrade", "--target", str(args.site), *FLASHINFER_IMPORTS)
    unpack_vllm(vllm, args.site)
    marker.write_text(wanted + "\n")
    print(f"conformance: {wanted} ready in {args.site}")


if __name__ == "__main__":
    main()
