"""Fixtures the end-to-end modules share; each module provides its own ``cluster`` (a module fixture)."""

from __future__ import annotations

import pytest
from cluster_support import checked_client


@pytest.fixture
def oracle(request, oracle_for):
    """The reference of the model the module's cluster serves ("tiny" where a test has no cluster with a
    ``preset``)."""
    cluster = request.getfixturevalue("cluster") if "cluster" in request.fixturenames else None
    return oracle_for(getattr(cluster, "preset", "tiny"))


@pytest.fixture
def client(cluster):
    """An OpenAI client of the module's cluster; afterwards nothing may be left held."""
    yield from checked_client(cluster)
