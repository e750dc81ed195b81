"""Install what the conformance tests need beside msa's own environment (`make conformance`).

Downloads the pinned wheels once into a cache directory (vLLM's is ~336 MB) and reuses them, then
lays out a directory for `PYTHONPATH`:

- FlashInfer 0.7.2.post1 (`pip install --no-deps`) and the few packages `flashinfer.msa_ops`
  imports (apache-tvm-ffi, requests, tqdm, nvidia-ml-py);
- vLLM 0.33.0's Python files and the `fmha_sm100` binding templates, unpacked from its wheel
  (`vllm` imports without its compiled extension), with its metadata so its version and its
  `vllm.general_plugins` entry points are known;
- SGLang 0.5.23's Python files, unpacked from its wheel, with its metadata;
- what vLLM's plugin loader and MiniMax-M3 attention modules and SGLang's MiniMax sparse decode
  module import beyond msa's environment (`ENGINE_IMPORTS`: pydantic, transformers, fastapi, ...,
  pinned within vLLM 0.33.0's bounds and installed without their dependencies, so torch, triton,
  numpy and the CUDA libraries stay those of msa's environment). Their wheels are cached too.

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

PINS = {"vllm": "0.33.0", "flashinfer-python": "0.7.2.post1", "sglang": "0.5.23"}
#: What `import flashinfer.msa_ops` needs beyond torch, numpy, packaging and jinja2.
FLASHINFER_IMPORTS = ("apache-tvm-ffi==0.1.11", "requests", "tqdm", "nvidia-ml-py")
#: What `vllm.models.minimax_m3.common.sparse_attention`, `...nvidia.sparse_attention_msa` (through
#: `vllm.config`, `vllm.v1.attention`, ...) and `sglang.srt.layers.attention.minimax_sparse_ops.minimax_sparse`
#: (through `sglang/__init__`, `sglang.srt.utils`) import beyond msa's test environment and
#: FLASHINFER_IMPORTS: resolved together within vLLM 0.33.0's bounds, with the dependencies of each
#: listed here but without torch, triton, numpy, the CUDA libraries and what msa's environment has.
ENGINE_IMPORTS = (
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "annotated-doc==0.0.7",
    "annotated-types==0.8.0", "anyio==4.16.0", "asttokens==3.0.2", "cachetools==8.0.2", "cbor2==6.3.0",
    "click==8.5.1", "cloudpickle==3.1.3", "executing==2.3.0", "fastapi==0.136.3", "frozenlist==1.8.0",
    "h11==0.16.0", "hf-xet==1.8.0", "httpcore2==2.16.2", "httpx2==2.16.2", "huggingface_hub==2.4.0",
    "ipython==9.18.1", "ipython_pygments_lexers==1.1.1", "jedi==0.20.1", "jiter==0.19.0", "llguidance==1.7.6",
    "markdown-it-py==4.3.0", "matplotlib-inline==0.2.2", "mdurl==0.1.2", "msgspec==0.23.0", "multidict==7.2.1",
    "openai==3.57.0", "opentelemetry-api==1.45.2", "orjson==3.13.0", "oss-harmony==0.0.11", "parso==0.8.7",
    "partial-json-parser==0.2.1.1.post7", "pexpect==4.9.0", "pillow==13.0.0", "prometheus_client==0.26.0",
    "prompt_toolkit==3.0.53", "propcache==0.5.4", "psutil==7.2.2", "ptyprocess==0.7.0", "pure_eval==0.2.4",
    "py-cpuinfo==9.0.0", "pybase64==1.5.1", "pydantic==2.14.4", "pydantic_core==2.50.5", "PyYAML==6.0.4",
    "pyzmq==27.3.0", "regex==2026.11.19", "rich==15.0.0", "safetensors==0.8.0", "shellingham==1.5.4",
    "sniffio==1.3.1", "stack-data==0.6.3", "starlette==1.10.0", "tokenizers==0.23.3", "traitlets==5.16.1",
    "transformers==5.20.2", "truststore==0.10.5", "typer==0.29.2", "typing-inspection==0.4.5", "uvloop==0.23.0",
    "wcwidth==0.9.4", "xgrammar==0.2.8", "yarl==1.25.1",
)
#: Any platform's wheel will do for the engines: only Python files and templates are used (SGLang
#: publishes manylinux_2_34 wheels only, vLLM manylinux_2_28 ones).
WHEEL_PLATFORM = ("--only-binary=:all:", "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
                  "--python-version", "3.11", "--implementation", "cp")
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


def unpack_sglang(path: Path, site: Path) -> None:
    """SGLang's Python files and the distribution metadata."""
    with zipfile.ZipFile(path) as archive:
        names = [
            n for n in archive.namelist()
            if (n.startswith("sglang/") and n.endswith(".py")) or (n.startswith("sglang-") and ".dist-info/" in n)
        ]
        archive.extractall(site, names)


def install_engine_imports(wheels: Path, site: Path) -> None:
    """ENGINE_IMPORTS into `site`, from wheels cached in `wheels/engine-imports` (downloaded for
    this machine's Python the first time)."""
    cache = wheels / "engine-imports"
    install = ("install", "-q", "--no-compile", "--no-deps", "--no-index", "--find-links", str(cache),
               "--target", str(site), "--upgrade", *ENGINE_IMPORTS)
    offline = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *install],
                             capture_output=True, text=True)
    if offline.returncode != 0:  # not all cached yet
        print(f"conformance: downloading the engines' imports into {cache}", flush=True)
        _pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(cache), *ENGINE_IMPORTS)
        _pip(*install)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, required=True, help="where the pinned wheels are cached")
    parser.add_argument("--site", type=Path, required=True, help="the directory to lay out (for PYTHONPATH)")
    args = parser.parse_args()
    args.wheels.mkdir(parents=True, exist_ok=True)
    pinned = " ".join(f"{n}=={v}" for n, v in PINS.items())
    wanted = " ".join([pinned, *ENGINE_IMPORTS])
    marker = args.site / MARKER
    if marker.is_file() and marker.read_text().strip() == wanted:
        marker.touch()
        print(f"conformance: {pinned} already in {args.site}")
        return
    vllm = wheel(args.wheels, "vllm", PINS["vllm"])
    flashinfer = wheel(args.wheels, "flashinfer-python", PINS["flashinfer-python"])
    sglang = wheel(args.wheels, "sglang", PINS["sglang"])
    shutil.rmtree(args.site, ignore_errors=True)
    args.site.mkdir(parents=True)
    print(f"conformance: installing into {args.site}", flush=True)
    _pip("install", "-q", "--no-compile", "--no-deps", "--target", str(args.site), str(flashinfer))
    _pip("install", "-q", "--no-compile", "--upgrade", "--target", str(args.site), *FLASHINFER_IMPORTS)
    install_engine_imports(args.wheels, args.site)
    unpack_vllm(vllm, args.site)
    unpack_sglang(sglang, args.site)
    marker.write_text(wanted + "\n")
    print(f"conformance: {pinned} ready in {args.site}")


if __name__ == "__main__":
    main()
