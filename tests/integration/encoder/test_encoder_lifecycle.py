"""Encoder process lifecycle with the real tiny model: serve -> SERVING -> stop event -> drained."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.common import grpc_utils
from services.encoder import main
from services.encoder.config import EncoderConfig


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    from services.common.models import build_checkpoint

    return str(build_checkpoint("tiny", tmp_path_factory.mktemp("encoder-main-model") / "tiny"))


async def test_serve_reports_ready_then_drains_on_stop(tiny_checkpoint: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = EncoderConfig(model=tiny_checkpoint, device="cpu", port=port, grace_s=0.5)
    stop = asyncio.Event()
    serving = asyncio.create_task(main.serve(config, stop))
    address = f"127.0.0.1:{port}"
    try:
        await grpc_utils.wait_healthy(address, "epd.v1.Encoder", timeout=30)
    finally:
        stop.set()
        await asyncio.wait_for(serving, 10)
    assert not await grpc_utils.check_health(address, "", timeout=0.5)
