"""One line per Nsight Compute metrics report (benchmarks/profile_misses.sh): the kernel's
duration, DRAM throughput, issue slots busy, warps active, and its three largest stall reasons
(warps stalled per issued instruction)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+inst\s+([\d.]+)")


def _metric(text: str, name: str, unit: bool = False) -> str:
    """`name`'s value in `text` (with its unit after it where `unit`), or "?"."""
    found = re.findall(rf"{re.escape(name)}\s+(\S+)\s+([\d.,]+)", text)
    if not found:
        return "?"
    return f"{found[0][1]} {found[0][0]}" if unit else found[0][1]


def summary(path: Path) -> str:
    """`path`'s line: name, duration, DRAM %, issue %, warps %, top stalls (one kernel a report)."""
    text = path.read_text(errors="replace")
    kernels = len(re.findall(r"gpu__time_duration\.sum", text))
    if kernels != 1:
        return f"{path.stem:28s} {kernels} kernels in the report: one expected"
    stalls = sorted(((float(v), k) for k, v in _STALL.findall(text) if k != "selected"), reverse=True)[:3]
    top = ", ".join(f"{k} {v:.2f}" for v, k in stalls)
    return (f"{path.stem:28s} {_metric(text, 'gpu__time_duration.sum', unit=True):>10}  DRAM "
            f"{_metric(text, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):>6}%  issue "
            f"{_metric(text, 'smsp__issue_active.avg.pct_of_peak_sustained_active'):>6}%  warps "
            f"{_metric(text, 'sm__warps_active.avg.pct_of_peak_sustained_active'):>6}%  {top}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(summary(Path(arg)))
