"""Runs a whole cluster (encoders, PDs, proxy) inside the test process.

Servers listen on 127.0.0.1 with ports chosen by binding port 0. Everything
runs on one asyncio loop in a background thread (the PD engine and encoder
workers have their own threads), so tests can use blocking clients such as
the official ``openai`` client from the main thread.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import openai
import uvicorn

from services.encoder.config import EncoderConfig
from services.encoder.server import start_encoder
from services.pd.config import PdConfig
from services.pd.server import start_pd
from services.proxy.app import create_app
from services.proxy.config import ProxyConfig

# The suite runs the same on a GPU machine: model servers started by tests run
# float32 (the oracle's precision; float32 on CUDA turns TF32 off) and size
# their KV cache from a fixed budget, so several PDs can share one GPU (sized
# from free memory, the first would take 90% of it).
TEST_PD_SETTINGS = {"dtype": "float32", "kv_cache_memory_mb": 1024}
TEST_ENCODER_SETTINGS = {"dtype": "float32"}


def pd_config(model_dir: str, **overrides: Any) -> PdConfig:
    """A PD config for an in-process test server: ``TEST_PD_SETTINGS`` under ``overrides``."""
    return PdConfig(model=model_dir, **{**TEST_PD_SETTINGS, **overrides})


def encoder_config(model_dir: str, **overrides: Any) -> EncoderConfig:
    """An encoder config for an in-process test server: ``TEST_ENCODER_SETTINGS`` under ``overrides``."""
    return EncoderConfig(model=model_dir, **{**TEST_ENCODER_SETTINGS, **overrides})


def free_ports(count: int) -> list[int]:
    """Ports picked by binding port 0 (then released for a child process to bind)."""
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
    ports = [s.getsockname()[1] for s in socks]
    for sock in socks:
        sock.close()
    return ports


class InProcessCluster:
    """N encoders + M PDs + the proxy, on loopback, for one test session or module.

    ``colocated=True``: one PD that runs the vision tower itself (``epd pd
    --encoder local``) and no encoder; the proxy's encoder is that PD.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        num_encoders: int = 1,
        num_pds: int = 1,
        pd: dict[str, Any] | None = None,
        encoder: dict[str, Any] | None = None,
        proxy: dict[str, Any] | None = None,
        with_proxy: bool = True,
        colocated: bool = False,
        num_decodes: int = 0,
        decode: dict[str, Any] | None = None,
    ):
        """``num_decodes`` > 0: E+P+D, the ``num_pds`` PDs are prefill instances and as many decode ones start
        (with ``pd``'s overrides, then ``decode``'s)."""
        self.model_dir = model_dir
        self.colocated = colocated
        self.num_encoders = 0 if colocated else num_encoders
        self.num_pds = 1 if colocated else num_pds
        self.pd_overrides = {**(pd or {}), **({"encoder": "local"} if colocated else {})}
        self.num_decodes = num_decodes
        if num_decodes:
            self.pd_overrides["role"] = "prefill"
        self.decodes: list[Any] = []
        self.decode_overrides = decode or {}
        self.encoder_overrides = encoder or {}
        self.proxy_overrides = proxy or {}
        self.with_proxy = with_proxy
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cluster-loop", daemon=True)
        self.pds: list[Any] = []
        self.encoders: list[Any] = []
        self.proxy_server: uvicorn.Server | None = None
        self.port = 0

    # -- lifecycle ------------------------------------------------------
    def start(self, timeout: float = 300) -> InProcessCluster:
        self.thread.start()
        self.run(self._start(), timeout=timeout)
        return self

    def stop(self) -> None:
        try:
            self.run(self._stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def run(self, coro: Coroutine, timeout: float = 120) -> Any:
        """Runs ``coro`` on the cluster's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pd_addresses(self) -> list[str]:
        return [f"127.0.0.1:{pd.port}" for pd in self.pds]

    @property
    def decode_addresses(self) -> list[str]:
        return [f"127.0.0.1:{pd.port}" for pd in self.decodes]

    @property
    def encoder_addresses(self) -> list[str]:
        if self.colocated:
            return self.pd_addresses
        return [f"127.0.0.1:{enc.port}" for enc in self.encoders]

    async def _start(self) -> None:
        # /metrics endpoints are off (the configs' default) unless a test asks: pd={"metrics_port": 0}.
        for _ in range(self.num_pds):
            config = pd_config(self.model_dir, host="127.0.0.1", port=0, **self.pd_overrides)
            self.pds.append(await start_pd(config))
        for _ in range(self.num_decodes):
            overrides = {**self.pd_overrides, **self.decode_overrides, "role": "decode"}
            self.decodes.append(await start_pd(pd_config(self.model_dir, host="127.0.0.1", port=0, **overrides)))
        for _ in range(self.num_encoders):
            config = encoder_config(self.model_dir, host="127.0.0.1", port=0, **self.encoder_overrides)
            self.encoders.append(await start_encoder(config))
        if self.with_proxy:
            await self._start_proxy()

    async def _start_proxy(self) -> None:
        proxy_config = ProxyConfig(
            model=self.model_dir,
            host="127.0.0.1",
            port=0,
            pd_addresses=tuple(self.pd_addresses),
            encoder_addresses=tuple(self.encoder_addresses),
            decode_addresses=tuple(self.decode_addresses),
            **self.proxy_overrides,
        )
        app = self.app = create_app(proxy_config)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.proxy_server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._proxy_task = asyncio.create_task(self.proxy_server.serve(sockets=[sock]))
        while not self.proxy_server.started:
            if self._proxy_task.done():
                self._proxy_task.result()
            await asyncio.sleep(0.02)

    async def _stop(self) -> None:
        if self.proxy_server is not None:
            self.proxy_server.should_exit = True
            await asyncio.wait_for(self._proxy_task, 30)
        for encoder in self.encoders:
            await encoder.stop(0)
        for pd in self.pds + self.decodes:
            await pd.stop(0)

    # -- leak checks ------------------------------------------------------
    async def _leaks(self) -> dict[str, int]:
        report: dict[str, int] = {}
        for i, pd in enumerate(self.pds + self.decodes):
            stats = await pd.stats()
            for key in (
                "reserved_tokens",
                "num_reservations",
                "num_running",
                "num_waiting",
                "num_kv_blocks_used",
                "num_live_requests",
                "referenced_tokens",
                "num_kv_reservations",
                "num_kv_exports",
            ):
                report[f"pd{i}.{key}"] = int(getattr(stats, key))
            servicer = getattr(pd, "servicer", None)
            if servicer is not None:  # pushes being received (their buffers), both kinds
                report[f"pd{i}.kv_pushes_in_flight"] = servicer.kv.slots.num_in_flight
                report[f"pd{i}.kv_push_buffer_bytes"] = servicer.kv.slots.buffered_bytes
                report[f"pd{i}.push_buffer_bytes"] = servicer.pushes.buffered_bytes
                if servicer.grammars is not None:  # constraints waiting for a compile, or in one
                    report[f"pd{i}.pending_grammar_compiles"] = servicer.grammars.num_pending
        for i, encoder in enumerate(self.encoders):
            stats = encoder.stats()
            if asyncio.iscoroutine(stats):
                stats = await stats
            if hasattr(stats, "_asdict"):
                stats = stats._asdict()
            for key in ("pending", "outbound_bytes", "num_pending", "in_flight"):
                if key in stats:
                    report[f"encoder{i}.{key}"] = int(stats[key])
        return report

    def leaks(self, settle_s: float = 5.0) -> dict[str, int]:
        """Non-zero leak counters after letting in-flight cleanup settle (empty = clean)."""
        deadline = time.monotonic() + settle_s
        while True:
            report = {k: v for k, v in self.run(self._leaks()).items() if v}
            if not report or time.monotonic() > deadline:
                return report
            time.sleep(0.05)


class ProxyThread:
    """The proxy app alone, served by uvicorn on a loop in a background thread (for tests whose
    backends are processes)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.app = create_app(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[sock]), self.loop)
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert not self.task.done(), self.task.result()
            assert time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def num_outstanding(self) -> int:
        """Calls this proxy has in flight on any backend (0 when idle)."""
        backends = self.app.state.proxy.backends
        return sum(instance.num_outstanding for instance in [*backends.pds, *backends.encoders])

    def stop(self) -> None:
        self.server.should_exit = True
        self.task.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def serving_preset(build_model: Any, preset: str, **cluster: Any) -> Iterator[InProcessCluster]:
    """A module fixture's body: an ``InProcessCluster`` serving ``preset`` (kept as ``.preset``), stopped after."""
    started = InProcessCluster(str(build_model(preset)), **cluster).start()
    started.preset = preset  # type: ignore[attr-defined]
    yield started
    started.stop()


def checked_client(cluster: InProcessCluster) -> Iterator[openai.OpenAI]:
    """A test fixture's body: an OpenAI client of ``cluster``; afterwards nothing may be left held."""
    with openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client
    assert cluster.leaks() == {}, "something was left reserved, held, pending or referenced"


def chat(client: openai.OpenAI, content: list[dict], max_tokens: int, stream: bool = False, **extensions: Any):
    """One greedy user turn of ``content``, answered whole or streamed: (the generated token ids, the usage).

    ``extensions`` go into the request body beside ``return_token_ids``.
    """
    kwargs: dict[str, Any] = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, **extensions},
    )
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return reply.choices[0].model_extra["token_ids"], reply.usage
    token_ids, usage = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            token_ids += (choice.model_extra or {}).get("token_ids") or []
    return token_ids, usage
