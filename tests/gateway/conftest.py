"""Fixtures the gateway tests share."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_helpers import SHARED_REDIS, delete_prefix, unique_prefix


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A Redis key prefix of this test's own on the tests' shared Redis (tagged with its module's
    name), every key under it deleted after the test."""
    p = unique_prefix(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))
    yield p
    delete_prefix(SHARED_REDIS, p)
