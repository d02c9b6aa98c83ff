"""Fixtures of the scheduler tests (``scheduler_harness.Harness``)."""

from __future__ import annotations

import pytest
from scheduler_harness import Harness


@pytest.fixture
def make():
    """Builds harnesses; each is checked once more when the test ends."""
    made: list[Harness] = []

    def factory(**kwargs) -> Harness:
        made.append(Harness(**kwargs))
        return made[-1]

    yield factory
    for harness in made:
        harness.check()


@pytest.fixture
def h(make):
    """A harness with the default limits (modules with their own ``h`` override it)."""
    return make()
