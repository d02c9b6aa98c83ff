"""Security review: the encoder dialled any ``pd_address`` an Encode named, with its token.

Real gRPC on 127.0.0.1: an encoder, the PD it is configured to know and a
second ("rogue") PD double that records whether anything reached it.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import grpc
import pytest
from test_encoder_server import (
    TEST_CONFIG,
    FakeVision,
    encode_request,
    extra_encoder,
    fake_loaded_vision,
    start_fake_pd,
    wait_idle,
)

from services.encoder.pd_allow import PdAllowSpec
from services.encoder.server import start_encoder


async def test_the_encoder_dials_only_the_pds_it_is_configured_to_know():
    pd_server, pd = await start_fake_pd()
    rogue_server, rogue = await start_fake_pd()
    vision = FakeVision()
    config = replace(TEST_CONFIG, pd_allow=PdAllowSpec.parse(f"127.0.0.1:{pd_server.port}"))
    try:
        async with extra_encoder(config, vision) as (encoder, stub):
            vision.reset_counts()
            rogue_address = f"127.0.0.1:{rogue_server.port}"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Encode(encode_request(rogue_address, 1.0), timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert rogue_address not in (refused.value.details() or "")
            assert str(rogue_server.port) not in (refused.value.details() or "")
            assert rogue.num_calls == 0 and vision.num_forwards == 0  # refused before any vision work or dial
            reply = await stub.Encode(encode_request(f"127.0.0.1:{pd_server.port}", 1.0), timeout=10)
            assert [item.mm_hash for item in reply.items] == ["hash-1.0"] and pd.num_calls == 1
            await wait_idle(encoder)
    finally:
        await rogue_server.stop(0)
        await pd_server.stop(0)


async def test_without_an_allow_list_only_loopback_pds_are_dialled():
    pd_server, pd = await start_fake_pd()
    vision = FakeVision()
    try:
        async with extra_encoder(TEST_CONFIG, vision) as (encoder, stub):
            vision.reset_counts()
            for address in ("10.255.255.1:50061", "pd.example:50061", "[2001:db8::1]:50061"):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Encode(encode_request(address, 2.0), timeout=10)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert address not in (refused.value.details() or "")
            assert vision.num_forwards == 0
            await stub.Encode(encode_request(f"localhost:{pd_server.port}", 2.0), timeout=10)
            assert pd.num_calls == 1
            await wait_idle(encoder)
    finally:
        await pd_server.stop(0)


async def test_a_malformed_pd_address_is_still_invalid_argument():
    vision = FakeVision()
    async with extra_encoder(TEST_CONFIG, vision) as (_encoder, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Encode(encode_request("pd 1:5", 3.0), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_allowing_any_pd_is_a_warning_at_start_up(caplog):
    vision = FakeVision()
    with caplog.at_level(logging.INFO, logger="services.encoder.server"):
        encoder = await start_encoder(
            replace(TEST_CONFIG, pd_allow=PdAllowSpec(any=True)), vision=fake_loaded_vision(vision)
        )
        await encoder.stop(0)
        encoder = await start_encoder(TEST_CONFIG, vision=fake_loaded_vision(vision))
        await encoder.stop(0)
    levels = {record.levelno for record in caplog.records if "allow" in record.getMessage()}
    assert levels == {logging.WARNING, logging.INFO}
    assert any("loopback addresses only" in record.getMessage() for record in caplog.records)


async def test_a_host_name_entry_allows_the_addresses_the_system_resolves_it_to():
    pd_server, pd = await start_fake_pd()
    vision = FakeVision()
    config = replace(TEST_CONFIG, pd_allow=PdAllowSpec.parse(f"localhost:{pd_server.port}"))
    try:
        async with extra_encoder(config, vision) as (encoder, stub):
            await stub.Encode(encode_request(f"127.0.0.1:{pd_server.port}", 5.0), timeout=10)  # localhost's address
            assert pd.num_calls == 1
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # the name, on another port
                await stub.Encode(encode_request(f"127.0.0.1:{pd_server.port + 1}", 5.0), timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            await wait_idle(encoder)
    finally:
        await pd_server.stop(0)
