"""Fixtures the end-to-end modules share; each module provides its own ``cluster`` (a module fixture)."""

from __future__ import annotations

import pytest
from cluster_support import checked_client


@pytest.fixture
def oracle(cluster, oracle_for):
    """The reference of the model the module's cluster serves."""
    return oracle_for(cluster.preset)


@pytest.fixture
def client(cluster):
    """An OpenAI client of the module's cluster; afterwards nothing may be left held."""
    yield from checked_client(cluster)
