"""`msa --help` answers without importing torch, triton or the backends: `import msa` is lazy
(PEP 562) and the `msa` parsers are built from `msa.cli.defaults`, the commands importing what
they need when they run. Functional checks (what a process has imported), not timings."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from msa.cli import build_parser
from msa.cli import defaults as cli_defaults

HEAVY = ("torch", "triton", "numpy", "msa.api", "msa.registry", "msa.layouts", "msa.backends")

#: Run in a fresh interpreter: the `msa` command on `argv`, then which heavy modules it imported.
PROBE = """
import json, sys
from msa.cli import main
code = main(sys.argv[1:])
heavy = {heavy!r}
print(json.dumps({{"code": code, "imported": sorted(m for m in heavy if m in sys.modules)}}))
"""


def probe(*argv: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return report


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["demo", "--help"], ["backends", "--help"], ["explain", "--help"], ["bench", "--help"],
     ["layouts", "--help"], ["version", "--help"], ["explain", "--heads", "64"], ["demo", "--batch", "0"]],
    ids=" ".join,
)
def test_help_and_bad_flags_import_no_torch(argv: list[str]) -> None:
    report = probe(*argv)
    assert report["code"] == (0 if "--help" in argv else 2)
    assert report["imported"] == [], f"msa {' '.join(argv)} imported {report['imported']}"


def test_import_msa_is_lazy() -> None:
    code = (
        "import sys, msa\n"
        "assert 'torch' not in sys.modules and 'msa.api' not in sys.modules, 'import msa is lazy'\n"
        "from msa import DecodePlanner, MSAInputError\n"
        "assert msa.MINIMAX_M3.num_q_heads == 64 and msa.DecodePlanner is DecodePlanner\n"
        "assert 'torch' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_every_exported_name_resolves() -> None:
    import msa.api
    import msa.errors
    import msa.layouts
    import msa.planner
    import msa.problem

    assert set(msa.__all__) <= set(dir(msa))
    for name in msa.__all__:
        assert getattr(msa, name) is not None, name
    assert msa.sparse_decode is msa.api.sparse_decode and msa.DecodePlanner is msa.planner.DecodePlanner
    assert msa.MINIMAX_M3 is msa.problem.MINIMAX_M3 and msa.get_layout is msa.layouts.get_layout
    assert msa.errors is sys.modules["msa.errors"] and msa.MSAInputError is msa.errors.MSAInputError
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        msa.not_a_name  # noqa: B018


def test_the_cli_copies_match_the_library() -> None:
    from msa.layouts import LAYOUT_NAMES
    from msa.platform import OPTIONAL_PACKAGES
    from msa.problem import CACHE_FORMS, MINIMAX_M3

    assert cli_defaults.LAYOUT_NAMES == LAYOUT_NAMES
    assert cli_defaults.CACHE_FORMS == CACHE_FORMS
    assert cli_defaults.OPTIONAL_PACKAGES == OPTIONAL_PACKAGES
    m3 = MINIMAX_M3
    copies = (cli_defaults.M3_HEADS, cli_defaults.M3_HEAD_DIM, cli_defaults.M3_PAGE_SIZE, cli_defaults.M3_TOPK)
    assert copies == ((m3.num_q_heads, m3.num_kv_heads), m3.head_dim, m3.page_size, m3.topk)
    for name in cli_defaults.Q_DTYPES.values():
        assert isinstance(getattr(torch, name), torch.dtype), name


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_has_help() -> None:
    missing = [
        f"msa {name} {action.option_strings[-1]}"
        for name, parser in commands().items()
        for action in parser._actions
        if action.option_strings and not action.help
    ]
    assert not missing, missing
