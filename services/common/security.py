"""Security of the internal gRPC transport (proxy -> encoder -> PD, proxy -> PD).

Two independent layers. A service started on its own has both off; ``epd up``
generates a token for its children unless told otherwise, and the shipped
compose and Kubernetes files read one from a secret:

- **Shared token.** Every internal call carries ``authorization: Bearer <token>``
  metadata; a server refuses a missing or wrong token with UNAUTHENTICATED
  (constant-time comparison). ``grpc.health.v1.Health`` is exempt, so probes
  need no secret, and clients never send it there (a health probe or watch
  may reach whatever took a restarting peer's port). Without TLS the token crosses the network in clear text: it
  keeps stray callers out, not eavesdroppers.
- **TLS / mTLS from PEM files.** ``--tls-cert`` + ``--tls-key`` turn TLS on.
  ``--tls-ca`` adds peer checks: servers then demand a client certificate
  signed by that CA (mTLS) and clients verify servers against it (without it,
  the system roots). One certificate per process serves both roles (the
  encoder is a server to the proxy and a client of PDs), so it must allow
  server and client authentication. The handshake precedes every RPC, so
  with mTLS health probes need the certificate too (``epd health`` takes the
  same flags and ``EPD_TLS_*`` variables).

Server reflection (``--grpc-reflection``) is off unless asked for; when on,
it sits behind the token like every method but health.

``/metrics`` endpoints are plain HTTP on their own ports. They can be bound
to loopback (``--metrics-host``) or, with ``--metrics-require-token``, put
behind the same token (``Authorization: Bearer <token>``, constant-time
check; ``metrics_http.MetricsHttpServer``), so a scraper needs the secret too.

The token and the private key are read once at start-up and never appear in
logs or reprs. Certificates are not reloaded: rotating them means a restart.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common import cli_args, launch_proof, secret_pipe

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
"""gRPC metadata key of the shared token (value ``Bearer <token>``)."""

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
"""Methods every caller may use: liveness and readiness probes carry no secret."""

TOKEN_ENV = "EPD_INTERNAL_TOKEN"
"""Environment variable holding the token itself (a flag would show it in ``ps``)."""

SECRET_ENVS = (TOKEN_ENV, launch_proof.LAUNCH_KEY_ENV, launch_proof.PEER_KEYS_ENV)
"""Variables ``epd up`` hands its children on a pipe, not in their environment (``secret_pipe``)."""

MIN_TOKEN_CHARS = 16
"""Shortest token accepted: a guessable secret is worse than none, it looks safe."""


def _check_token(token: str) -> None:
    # Metadata values must be printable ASCII; spaces would be ambiguous after "Bearer ".
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the internal token must be at least {MIN_TOKEN_CHARS} characters")
    if not all("!" <= ch <= "~" for ch in token):
        raise ValueError("the internal token must be printable ASCII without spaces")


def _check_pem(name: str, data: bytes | None) -> None:
    if data is not None and b"-----BEGIN " not in data:
        raise ValueError(f"{name} is not PEM (no '-----BEGIN' line)")


@dataclass(frozen=True, repr=False)
class InternalSecurity:
    """How one process protects and authenticates its internal gRPC calls (both roles).

    Built once at start-up (``from_args`` or a test) and passed in; validated
    on construction. PEM contents, not paths, so nothing reads files later.
    """

    token: str | None = None
    """Shared secret every non-health call must carry; None = no token check, none sent."""
    tls_cert: bytes | None = None
    """PEM certificate chain of this process (server and client); None = plaintext."""
    tls_key: bytes | None = None
    """PEM private key of ``tls_cert``."""
    tls_ca: bytes | None = None
    """PEM CA bundle: servers require client certificates it signed; clients verify servers with it."""
    tls_server_name: str = ""
    """Name clients expect in servers' certificates instead of the dialled host ('' = that host).
    Needed when the proxy dials pod IPs that a DNS name resolved to."""
    reflection: bool = False
    """Serve gRPC server reflection (for grpcurl and similar tools)."""
    metrics_auth: bool = False
    """``/metrics`` answers only requests carrying ``Authorization: Bearer <token>`` (needs ``token``)."""
    launch_key: str | None = None
    """This process's key from ``epd up`` (``$EPD_LAUNCH_KEY``): health checks are answered with a proof of it
    (``launch_proof``), so peers can tell this process from another on its port. None = not launched so."""
    peer_launch_keys: tuple[tuple[str, str], ...] = ()
    """``(address, key)`` of the peers ``epd up`` started (``$EPD_PEER_LAUNCH_KEYS``): a peer at such an
    address counts as ready only once it proved that key, before any call with the token goes there."""

    def peer_launch_key(self, address: str) -> str | None:
        """The key the listener at ``address`` must prove, or None when it was not given."""
        return dict(self.peer_launch_keys).get(address)

    def __post_init__(self) -> None:
        if self.token is not None:
            _check_token(self.token)
        if self.metrics_auth and self.token is None:
            raise ValueError("--metrics-require-token needs an internal token")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_cert is None and (self.tls_ca is not None or self.tls_server_name):
            raise ValueError("--tls-ca and --tls-server-name need --tls-cert and --tls-key")
        for name, data in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            _check_pem(name, data)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def mtls(self) -> bool:
        """Servers require (and clients present) CA-signed certificates."""
        return self.tls and self.tls_ca is not None

    def describe(self) -> str:
        """What is on, for start-up logs (no secrets): e.g. ``mtls+token``, ``plaintext``."""
        parts = ["mtls" if self.mtls else "tls" if self.tls else "plaintext"]
        if self.token is not None:
            parts.append("token")
        if self.reflection:
            parts.append("reflection")
        if self.metrics_auth:
            parts.append("metrics-token")
        if self.launch_key is not None:
            parts.append("launch-proof")
        return "+".join(parts)

    def __repr__(self) -> str:
        return f"InternalSecurity({self.describe()})"

    @property
    def metrics_token(self) -> str | None:
        """The token a ``/metrics`` request must carry, or None when the endpoint is open."""
        return self.token if self.metrics_auth else None

    # -- server side ----------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for ``add_secure_port``; None = serve plaintext."""
        if self.tls_key is None or self.tls_cert is None:  # not self.tls: __post_init__ wants both or neither
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)],
            root_certificates=self.tls_ca,
            require_client_auth=self.tls_ca is not None,
        )

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Outermost interceptors of a server: the token check, when a token is set."""
        return [TokenCheckInterceptor(self.token)] if self.token is not None else []

    # -- client side ----------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials presenting this process's certificate; None = plaintext channel."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca, private_key=self.tls_key, certificate_chain=self.tls_cert
        )

    def channel_options(self) -> tuple[tuple[str, str], ...]:
        if self.tls_server_name:
            return (("grpc.ssl_target_name_override", self.tls_server_name),)
        return ()

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """Interceptors that attach the token to every call of a channel but health (all four arities)."""
        if self.token is None:
            return []
        entry = (AUTH_METADATA_KEY, f"Bearer {self.token}")
        # One object per arity: grpc.aio files each interceptor under its first matching kind only.
        return [_UnaryUnaryToken(entry), _UnaryStreamToken(entry), _StreamUnaryToken(entry), _StreamStreamToken(entry)]


NO_SECURITY = InternalSecurity()
"""Plaintext, no token, no reflection: the default everywhere."""


# -- server-side token check ----------------------------------------------------
class TokenCheckInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right ``authorization`` metadata (UNAUTHENTICATED); health is exempt."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self.num_refused = 0

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """True when exactly the expected value is present (constant time in the value)."""
        ok = False
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY:
                raw = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
                ok |= hmac.compare_digest(raw, self._expected)
        return ok

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        self.num_refused += 1
        # Logged at the 1st, 10th, 100th, ... refusal: visible, but a caller cannot flood the log.
        # ``method`` names a registered handler (unknown ones returned above), not free client text.
        if str(self.num_refused).rstrip("0") == "1":
            log.warning("refused %s: missing or wrong internal token (%d refused so far)", method, self.num_refused)
        return _refusing(handler)


async def _refuse(unused_request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid internal token")


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same arity as ``handler`` that ends the call UNAUTHENTICATED.

    No request deserializer: an unauthenticated caller's message is never parsed.
    """
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(_refuse, response_serializer=handler.response_serializer)


# -- client-side token ----------------------------------------------------------
class _AttachToken:
    def __init__(self, entry: tuple[str, str]) -> None:
        self._entry = entry

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.startswith(HEALTH_METHOD_PREFIX):
            # Health is exempt on the server, so the token would only inform whoever listens: a
            # probe or watch may reach a process that took a restarting peer's port.
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._entry)
        # The same five fields as the namedtuple's _replace (which grpc's stubs do not declare).
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnaryToken(_AttachToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamToken(_AttachToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryToken(_AttachToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamToken(_AttachToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


# -- flags ----------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser, *, grpc_server: bool) -> None:
    """The internal-security flags; identical on every service (``grpc_server`` adds reflection)."""
    group = parser.add_argument_group("internal transport security")
    add = cli_args.add_flag
    add(
        group,
        "--internal-token-file",
        default="",
        help=f"file holding the shared token every internal gRPC call must carry (health exempt); "
        f"or put the token itself in ${TOKEN_ENV} ('' = no token)",
    )
    add(group, "--tls-cert", default="", help="PEM certificate chain of this process: turns TLS on (with --tls-key)")
    add(group, "--tls-key", default="", help="PEM private key of --tls-cert")
    add(
        group,
        "--tls-ca",
        default="",
        help="PEM CA bundle: servers then require client certificates (mTLS), clients verify servers with it",
    )
    add(
        group,
        "--tls-server-name",
        default="",
        help="name expected in peers' certificates instead of the dialled host ('' = that host)",
    )
    if grpc_server:
        add(group, "--grpc-reflection", default=False, help="serve gRPC server reflection (behind the token)")


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-require-token``: the ``/metrics`` endpoint demands the internal token."""
    cli_args.add_flag(
        parser,
        "--metrics-require-token",
        default=False,
        help="/metrics answers only requests with 'Authorization: Bearer <internal token>' "
        "(needs an internal token); off = open to whoever reaches --metrics-host",
    )


_FILE_FLAGS = ("internal_token_file", "tls_cert", "tls_key", "tls_ca", "tls_server_name")


def forward_argv(args: argparse.Namespace, *, grpc_server: bool) -> list[str]:
    """The flags of ``args`` set by the user, as argv for a child service (``epd up``)."""
    argv = []
    for name in _FILE_FLAGS:
        value = getattr(args, name, "")
        if value:
            argv += ["--" + name.replace("_", "-"), value]
    if grpc_server and getattr(args, "grpc_reflection", False):
        argv.append("--grpc-reflection")
    return argv


def _read(flag: str, path: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {flag} file {path}: {error.strerror}") from None


def from_args(args: argparse.Namespace, environ: MutableMapping[str, str] | None = None) -> InternalSecurity:
    """Reads the files named by the flags, ``$EPD_INTERNAL_TOKEN`` and the launch keys; ValueError when invalid.

    Under ``epd up`` the token and keys come on the pipe ``$EPD_SECRETS_FD``
    names, read here once (``secret_pipe.receive``), not from the environment.
    """
    environ = os.environ if environ is None else environ
    environ = {**environ, **secret_pipe.receive(environ)}
    token_file = getattr(args, "internal_token_file", "")
    token_env = environ.get(TOKEN_ENV, "")
    if token_file and token_env:
        raise ValueError(f"give the internal token once: --internal-token-file or ${TOKEN_ENV}, not both")
    token = token_env.strip()
    if token_file:
        token = (_read("--internal-token-file", token_file) or b"").decode("ascii", "replace").strip()
        if not token:
            raise ValueError("--internal-token-file is empty")
    return InternalSecurity(
        token=token or None,
        tls_cert=_read("--tls-cert", getattr(args, "tls_cert", "")),
        tls_key=_read("--tls-key", getattr(args, "tls_key", "")),
        tls_ca=_read("--tls-ca", getattr(args, "tls_ca", "")),
        tls_server_name=getattr(args, "tls_server_name", ""),
        reflection=bool(getattr(args, "grpc_reflection", False)),
        metrics_auth=bool(getattr(args, "metrics_require_token", False)),
        launch_key=environ.get(launch_proof.LAUNCH_KEY_ENV) or None,
        peer_launch_keys=launch_proof.parse_peer_keys(environ.get(launch_proof.PEER_KEYS_ENV, "")),
    )
