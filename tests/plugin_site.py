"""Installing test plugins the way pip does: a module plus a `*.dist-info` with its entry point
in the `msa.backends` group, in a directory on `sys.path`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path


def install_plugins(site: Path, names: Iterable[str], sources: Mapping[str, str]) -> None:
    """Write each plugin module `sources[name]` and a `<name>-1.0.dist-info` with its entry point."""
    for name in names:
        (site / f"{name}.py").write_text(sources[name])
        info = site / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[msa.backends]\n{name} = {name}\n")
