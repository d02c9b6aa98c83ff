"""The proxy's side of ``epd up``'s launch proof: a listener on a restarting PD's port never gets the token.

Second review, 7: a local process that binds a restarting child's port got the internal token. The
proxy sends the token on every call to a PD; under ``epd up`` it is given each PD's launch key, and a PD
is routable only once the listener proved that key on a freshly opened health watch.
"""

from __future__ import annotations

import asyncio

import grpc

from services.common import grpc_utils, launch_proof, security
from services.common.security import InternalSecurity
from services.launcher import command as up
from services.proxy.backends.instances import PdClient, Readiness
from services.proxy.backends.monitor import Monitor

TOKEN = "t" * 32
PD_SERVICE = "epd.v1.PrefillDecode"


class RecordMetadata(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def intercept_service(self, continuation, handler_call_details):
        self.seen.extend((key, str(value)) for key, value in handler_call_details.invocation_metadata or ())
        return await continuation(handler_call_details)


async def _listener(launch_key: str | None, recorder: RecordMetadata) -> grpc_utils.GrpcServer:
    server = await grpc_utils.start_server(
        "127.0.0.1",
        0,
        PD_SERVICE,
        lambda _: None,
        interceptors=[recorder],
        security=InternalSecurity(launch_key=launch_key),
    )
    await server.set_ready(True)
    return server


async def _watched(address: str, launch_key: str) -> tuple[PdClient, Monitor]:
    channel = grpc_utils.aio_channel(address, InternalSecurity(token=TOKEN))
    pd = PdClient(address, channel, launch_key=launch_key)
    monitor = Monitor(load_interval_s=0.05, retry_s=0.05, max_retry_s=0.1, rpc_timeout_s=1.0)
    monitor.watch(pd)
    return pd, monitor


async def test_a_listener_on_a_restarting_pds_port_is_never_routed_to_nor_sent_the_token():
    recorder = RecordMetadata()
    impostor = await _listener(None, recorder)  # answers SERVING, knows no launch key
    address = f"127.0.0.1:{impostor.port}"
    pd, monitor = await _watched(address, launch_proof.new_launch_key())
    try:
        assert not pd.routable()  # not even before its first answer
        await asyncio.sleep(1.0)  # many watches and challenges
        assert pd.readiness is not Readiness.READY and not pd.routable()
        assert any(key == launch_proof.CHALLENGE_METADATA_KEY for key, _ in recorder.seen)
        assert all(key != security.AUTH_METADATA_KEY for key, _ in recorder.seen)
    finally:
        await monitor.close()
        await pd.channel.close()
        await impostor.stop(0)


async def test_a_pd_that_proves_its_launch_key_is_routed_to():
    recorder, key = RecordMetadata(), launch_proof.new_launch_key()
    genuine = await _listener(key, recorder)
    pd, monitor = await _watched(f"127.0.0.1:{genuine.port}", key)
    try:
        for _ in range(100):
            if pd.readiness is Readiness.READY:
                break
            await asyncio.sleep(0.02)
        assert pd.readiness is Readiness.READY and pd.routable()
    finally:
        await monitor.close()
        await pd.channel.close()
        await genuine.stop(0)


def test_the_proxy_reads_its_peers_keys_from_its_environment():
    import argparse

    environ = {launch_proof.PEER_KEYS_ENV: "127.0.0.1:21061=abc,127.0.0.1:21051=def"}
    config = security.from_args(argparse.Namespace(), environ)
    assert config.peer_launch_key("127.0.0.1:21061") == "abc"
    assert config.peer_launch_key("127.0.0.1:21051") == "def"
    assert config.peer_launch_key("127.0.0.1:21062") is None


async def test_the_proxy_proves_its_launch_key_on_http_health(cluster_factory):
    """``epd up`` verifies a restarted proxy too: a listener on its port answering 200 is not the proxy."""
    key = launch_proof.new_launch_key()
    cluster = await cluster_factory(http=True, security=InternalSecurity(launch_key=key))
    address = cluster.base_url.removeprefix("http://")
    assert await asyncio.to_thread(up._http_ready, address, key)
    assert await asyncio.to_thread(up._http_answers, address, key, 2.0)
    assert not await asyncio.to_thread(up._http_ready, address, launch_proof.new_launch_key())
    reply = await cluster.client.get("/health")  # no challenge, no proof
    assert reply.status_code == 200 and launch_proof.PROOF_METADATA_KEY not in reply.headers


async def test_cluster_ready_waits_until_the_proxy_routes_to_every_instance(cluster_factory):
    """``epd up`` says ``cluster ready`` once the proxy's health watch sees every service, not just one PD."""
    key = launch_proof.new_launch_key()
    cluster = await cluster_factory(num_pds=2, http=True, security=InternalSecurity(launch_key=key))
    address = cluster.base_url.removeprefix("http://")
    await asyncio.wait_for(_until(up._http_routes_to_all, address, key), 10)
    await cluster.servers[1].set_ready(False)  # the second PD: NOT_SERVING
    await asyncio.wait_for(_until(lambda *a: not up._http_routes_to_all(*a), address, key), 10)
    assert await asyncio.to_thread(up._http_ready, address, key)  # one PD is enough for /health's 200
    await cluster.servers[1].set_ready(True)
    await asyncio.wait_for(_until(up._http_routes_to_all, address, key), 10)


async def _until(check, *args) -> None:
    while not await asyncio.to_thread(check, *args):
        await asyncio.sleep(0.05)
