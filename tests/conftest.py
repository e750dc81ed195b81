"""Shared fixtures: fresh random data every run, with the seed printed on failure.

Set MSA_TEST_SEED=<n> to replay a failing run.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> Iterator[int]:
    value = int(os.environ.get("MSA_TEST_SEED", secrets.randbits(31)))
    request.node.user_properties.append(("seed", value))
    torch.manual_seed(value)
    yield value


@pytest.fixture
def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    seeds = [v for k, v in item.user_properties if k == "seed"]
    if report.failed and seeds:
        report.sections.append(("seed", f"replay with MSA_TEST_SEED={seeds[0]}"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
