"""One line per Nsight Compute metrics report (benchmarks/profile_misses.sh): the kernel's
duration, DRAM throughput, issue slots busy, warps active, and its three largest stall reasons
(warps stalled per issued instruction)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+inst\s+([\d.]+)")


def _metric(text: str, name: str) -> str:
    found = re.findall(rf"{re.escape(name)}\s+\S+\s+([\d.,]+)", text)
    return found[-1] if found else "?"


def summary(path: Path) -> str:
    """`path`'s line: name, us, DRAM %, issue %, warps %, top stalls."""
    text = path.read_text(errors="replace")
    stalls = sorted(((float(v), k) for k, v in _STALL.findall(text) if k != "selected"), reverse=True)[:3]
    top = ", ".join(f"{k} {v:.2f}" for v, k in stalls)
    return (f"{path.stem:28s} {_metric(text, 'gpu__time_duration.sum'):>8} us  DRAM "
            f"{_metric(text, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):>6}%  issue "
            f"{_metric(text, 'smsp__issue_active.avg.pct_of_peak_sustained_active'):>6}%  warps "
            f"{_metric(text, 'sm__warps_active.avg.pct_of_peak_sustained_active'):>6}%  {top}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(summary(Path(arg)))
