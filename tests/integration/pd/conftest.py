"""Fixtures shared by the PD gRPC tests."""

from __future__ import annotations

import grpc
import pytest

from services.common.models import load_adapter
from services.common.pb import epd_pb2_grpc


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    return load_adapter(str(tiny_model_dir))


@pytest.fixture
def stub(pd_cluster):
    """A PD stub on the module's ``pd_cluster``; after each test nothing may be left reserved, pending or referenced."""
    with grpc.insecure_channel(pd_cluster.pd_addresses[0]) as channel:
        yield epd_pb2_grpc.PrefillDecodeStub(channel)
    assert pd_cluster.leaks() == {}, "PD left something reserved, pending or referenced"
