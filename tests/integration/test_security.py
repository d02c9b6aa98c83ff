"""Internal transport security against real gRPC servers: token, TLS, mTLS, reflection, health.

A throwaway CA and certificates (127.0.0.1 / localhost) are made per module
with ``cryptography``. The gRPC calls go to a test double service (bytes in,
bytes out, all four arities) on ``grpc_utils.start_server``, the code every
service uses; the last tests run a whole in-process cluster through the proxy.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from cluster_support import InProcessCluster
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from oracle_support import make_image, user_message

from services.common import grpc_utils
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.common.security import NO_SECURITY, InternalSecurity

TOKEN = "s3cret-token-0123456789abcdef"
SERVICE = "epd.test.EchoDouble"
READY = "epd.test.EchoDouble"


# -- a throwaway PKI ------------------------------------------------------------
def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class Authority:
    """A CA that signs leaf certificates valid for 127.0.0.1 and localhost."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) usable as server and client, as every EPD process needs."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def security(self, name: str, **kwargs) -> InternalSecurity:
        cert, key = self.issue(name)
        return InternalSecurity(tls_cert=cert, tls_key=key, tls_ca=self.pem, **kwargs)


@pytest.fixture(scope="module")
def ca() -> Authority:
    return Authority.create("epd test CA")


@pytest.fixture(scope="module")
def rogue_ca() -> Authority:
    return Authority.create("someone else's CA")


# -- the test double service ----------------------------------------------------
def _echo_double_handler() -> grpc.GenericRpcHandler:
    """Test double: bytes echo service with one method per arity (no serializers)."""

    async def unary(request: bytes, context) -> bytes:
        return request

    async def server_stream(request: bytes, context):
        yield request
        yield request

    async def client_stream(requests, context) -> bytes:
        return b"".join([chunk async for chunk in requests])

    async def bidi(requests, context):
        async for chunk in requests:
            yield chunk

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
            "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        },
    )


async def start_double(security: InternalSecurity) -> grpc_utils.GrpcServer:
    server = await grpc_utils.start_server(
        "127.0.0.1", 0, READY, lambda s: s.add_generic_rpc_handlers((_echo_double_handler(),)), security=security
    )
    await server.set_ready(True)
    return server


async def _requests():
    yield b"ab"
    yield b"cd"


async def call_every_arity(channel: grpc.aio.Channel) -> list[bytes]:
    """One call of each arity; raises the first AioRpcError."""
    unary = await channel.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=5)
    streamed = [m async for m in channel.unary_stream(f"/{SERVICE}/ServerStream")(b"y", timeout=5)]
    joined = await channel.stream_unary(f"/{SERVICE}/ClientStream")(_requests(), timeout=5)
    echoed = [m async for m in channel.stream_stream(f"/{SERVICE}/Bidi")(_requests(), timeout=5)]
    return [unary, *streamed, joined, *echoed]


EXPECTED = [b"x", b"y", b"y", b"abcd", b"ab", b"cd"]


async def codes_of_each_arity(channel: grpc.aio.Channel) -> set[grpc.StatusCode]:
    """The status of one call of each arity (the streaming-request ones write nothing)."""
    codes = set()
    for call in (
        channel.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=5),
        channel.unary_stream(f"/{SERVICE}/ServerStream")(b"y", timeout=5),
    ):
        codes.add(await call.code())
    # A write racing the server's refusal can turn its status into a local
    # "INTERNAL: Internal error from Core" (grpc/grpc#36066, see the encoder's
    # pusher); the refusal itself happens on the call's headers, so these calls
    # only open the stream and read its status.
    for call in (
        channel.stream_unary(f"/{SERVICE}/ClientStream")(timeout=5),
        channel.stream_stream(f"/{SERVICE}/Bidi")(timeout=5),
    ):
        codes.add(await call.code())
    return codes


# -- token ----------------------------------------------------------------------
async def test_token_refuses_missing_and_wrong_tokens_on_every_arity_and_exempts_health(caplog):
    server = await start_double(InternalSecurity(token=TOKEN))
    address = f"127.0.0.1:{server.port}"
    try:
        async with grpc_utils.aio_channel(address) as channel:
            assert await codes_of_each_arity(channel) == {grpc.StatusCode.UNAUTHENTICATED}
        async with grpc_utils.aio_channel(address, InternalSecurity(token=TOKEN[:-1] + "X")) as channel:
            assert await codes_of_each_arity(channel) == {grpc.StatusCode.UNAUTHENTICATED}
            assert await _code_of_unary(channel) == grpc.StatusCode.UNAUTHENTICATED
            assert await _code_of_unary(channel) == grpc.StatusCode.UNAUTHENTICATED
        # 10 refusals, 2 log lines (the 1st and the 10th); the token is never logged.
        refusals = [r.getMessage() for r in caplog.records if "internal token" in r.getMessage()]
        assert [m.endswith(f"({n} refused so far)") for m, n in zip(refusals, (1, 10))] == [True, True]
        assert len(refusals) == 2 and not any(TOKEN[:8] in m for m in caplog.messages)
        async with grpc_utils.aio_channel(address, InternalSecurity(token=TOKEN)) as channel:
            assert await call_every_arity(channel) == EXPECTED
        # Health answers without any token: liveness and readiness.
        assert await grpc_utils.check_health(address, "")
        assert await grpc_utils.check_health(address, READY)
    finally:
        await server.stop(0)


async def test_without_a_token_configured_calls_need_none():
    server = await start_double(NO_SECURITY)
    try:
        async with grpc_utils.aio_channel(f"127.0.0.1:{server.port}") as channel:
            assert await call_every_arity(channel) == EXPECTED
    finally:
        await server.stop(0)


# -- reflection -----------------------------------------------------------------
async def _list_services(channel: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    async for reply in stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    ):
        return [service.name for service in reply.list_services_response.service]
    return []


async def test_reflection_is_off_unless_asked_for_and_sits_behind_the_token():
    plain = await start_double(NO_SECURITY)
    reflecting = await start_double(InternalSecurity(token=TOKEN, reflection=True))
    try:
        async with grpc_utils.aio_channel(f"127.0.0.1:{plain.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _list_services(channel)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        address = f"127.0.0.1:{reflecting.port}"
        async with grpc_utils.aio_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _list_services(channel)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with grpc_utils.aio_channel(address, InternalSecurity(token=TOKEN)) as channel:
            assert SERVICE in await _list_services(channel)
    finally:
        await plain.stop(0)
        await reflecting.stop(0)


# -- TLS and mTLS ---------------------------------------------------------------
async def _unary(channel: grpc.aio.Channel) -> bytes:
    return await channel.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=5)


async def _code_of_unary(channel: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _unary(channel)
    return info.value.code()


async def test_mtls_refuses_clients_without_a_certificate_of_its_ca(ca, rogue_ca):
    server = await start_double(ca.security("server"))
    address = f"127.0.0.1:{server.port}"
    try:
        async with grpc_utils.aio_channel(address) as channel:  # plaintext
            assert await _code_of_unary(channel) == grpc.StatusCode.UNAVAILABLE
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca.pem)  # TLS, but no client certificate
        async with grpc.aio.secure_channel(address, no_cert) as channel:
            assert await _code_of_unary(channel) == grpc.StatusCode.UNAVAILABLE
        rogue_cert, rogue_key = rogue_ca.issue("intruder")
        rogue = InternalSecurity(tls_cert=rogue_cert, tls_key=rogue_key, tls_ca=ca.pem)
        async with grpc_utils.aio_channel(address, rogue) as channel:
            assert await _code_of_unary(channel) == grpc.StatusCode.UNAVAILABLE
        async with grpc_utils.aio_channel(address, ca.security("proxy")) as channel:
            assert await call_every_arity(channel) == EXPECTED
        # The handshake precedes health: probes need the certificate too.
        assert not await grpc_utils.check_health(address, READY, timeout=2)
        assert await grpc_utils.check_health(address, READY, security=ca.security("probe"))
    finally:
        await server.stop(0)


async def test_clients_check_the_server_name(ca):
    server = await start_double(ca.security("server"))
    address = f"127.0.0.1:{server.port}"
    try:
        # The certificate names localhost and 127.0.0.1; a client expecting another name refuses it.
        async with grpc_utils.aio_channel(address, ca.security("proxy", tls_server_name="pd.internal")) as channel:
            assert await _code_of_unary(channel) == grpc.StatusCode.UNAVAILABLE
        async with grpc_utils.aio_channel(address, ca.security("proxy", tls_server_name="localhost")) as channel:
            assert await _unary(channel) == b"x"
    finally:
        await server.stop(0)


async def test_tls_without_a_ca_encrypts_but_asks_no_client_certificate(ca):
    cert, key = ca.issue("server")
    server = await start_double(InternalSecurity(tls_cert=cert, tls_key=key))
    address = f"127.0.0.1:{server.port}"
    try:
        async with grpc_utils.aio_channel(address) as channel:  # plaintext is still refused
            assert await _code_of_unary(channel) == grpc.StatusCode.UNAVAILABLE
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca.pem)
        async with grpc.aio.secure_channel(address, no_cert) as channel:
            assert await _unary(channel) == b"x"
    finally:
        await server.stop(0)


async def test_mtls_and_token_together(ca):
    server = await start_double(ca.security("server", token=TOKEN))
    address = f"127.0.0.1:{server.port}"
    try:
        async with grpc_utils.aio_channel(address, ca.security("proxy")) as channel:  # cert, no token
            assert await _code_of_unary(channel) == grpc.StatusCode.UNAUTHENTICATED
        async with grpc_utils.aio_channel(address, ca.security("proxy", token=TOKEN)) as channel:
            assert await call_every_arity(channel) == EXPECTED
    finally:
        await server.stop(0)


# -- epd health -----------------------------------------------------------------
async def _health(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``epd health`` as a process, as a container runtime runs it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.common.healthcheck",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode, output.decode()


async def test_epd_health_takes_the_tls_flags_and_their_env_variables(ca, tmp_path: Path, monkeypatch):
    server = await start_double(ca.security("server", token=TOKEN))
    cert, key = ca.issue("probe")
    files = {"cert": cert, "key": key, "ca": ca.pem}
    for name, data in files.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
    tls_flags = [arg for name in files for arg in (f"--tls-{name}", str(tmp_path / f"{name}.pem"))]
    address = ["--address", f"127.0.0.1:{server.port}", "--service", READY]
    for name in ("EPD_TLS_CERT", "EPD_TLS_KEY", "EPD_TLS_CA", "EPD_INTERNAL_TOKEN", "EPD_INTERNAL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    try:
        code, output = await _health(*address)
        assert code == 1 and "NOT READY" in output
        code, output = await _health(*address, *tls_flags)  # no token needed for health
        assert code == 0, output
        env = {**os.environ, **{f"EPD_TLS_{name.upper()}": str(tmp_path / f"{name}.pem") for name in files}}
        code, output = await _health(*address, env=env)  # what a container with EPD_TLS_* set runs
        assert code == 0, output
        code, output = await _health(*address, "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", "x")
        assert code == 2 and "cannot read --tls-cert" in output
    finally:
        await server.stop(0)


# -- a whole cluster ------------------------------------------------------------
def _chat(cluster: InProcessCluster) -> httpx.Response:
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        model = client.get("/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "messages": [user_message("What is in this picture?", [make_image(7)])],
            "max_tokens": 4,
        }
        return client.post("/chat/completions", json=body)


@pytest.mark.parametrize("mode", ["token", "mtls"])
def test_cluster_serves_through_the_proxy_with_internal_security_on(tiny_model_dir, ca, mode):
    def make(name: str) -> InternalSecurity:
        return InternalSecurity(token=TOKEN) if mode == "token" else ca.security(name)

    cluster = InProcessCluster(
        str(tiny_model_dir),
        encoder={"security": make("encoder"), "warmup": False},
        pd={"security": make("pd"), "warmup": False},
        proxy={"security": make("proxy")},
    )
    cluster.start()
    try:
        reply = _chat(cluster)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] is not None
        assert cluster.leaks() == {}

        async def refused_outsider() -> set[grpc.StatusCode]:
            codes = set()
            for address, stub_cls in (
                (cluster.pd_addresses[0], epd_pb2_grpc.PrefillDecodeStub),
                (cluster.encoder_addresses[0], epd_pb2_grpc.EncoderStub),
            ):
                async with grpc_utils.aio_channel(address) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub_cls(channel).GetLoad(epd_pb2.GetLoadRequest(), timeout=5)
                    codes.add(info.value.code())
            return codes

        expected = grpc.StatusCode.UNAUTHENTICATED if mode == "token" else grpc.StatusCode.UNAVAILABLE
        assert cluster.run(refused_outsider()) == {expected}
    finally:
        cluster.stop()
