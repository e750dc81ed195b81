"""Property test of the E2M1 rounding (hypothesis, a test extra)."""

from __future__ import annotations

import pytest
import torch

from msa.layouts.nvfp4 import E2M1_VALUES, e2m1_encode

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.floats(min_value=-20, max_value=20, allow_nan=False, width=32))
def test_e2m1_code_is_a_nearest_value(x: float) -> None:
    code = int(e2m1_encode(torch.tensor([x]))[0])
    value = E2M1_VALUES[code]
    target = max(min(x, 6.0), -6.0)
    best = min(abs(target - v) for v in E2M1_VALUES)
    assert abs(target - value) == best
    assert (code >= 8) == (x < 0)


