"""Test doubles for proxy integration tests: fake PD and encoder gRPC servers.

``FakePd`` and ``FakeEncoder`` are real gRPC servers on 127.0.0.1:0 with
scripted behaviour. The fake encoder "pushes" by marking reservations filled
on the fake PD, and the fake PD's Generate waits for every reservation it
was given before streaming: a proxy that did not run Generate and Encode
concurrently, or sent wrong reservation ids, would hang (and time out).
"""

from __future__ import annotations

import asyncio
import base64
import io
from dataclasses import dataclass, field

import grpc
import httpx
import openai
from PIL import Image

from services.common import grpc_utils
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.proxy.config import ProxyConfig


def metadata_request_id(context: grpc.aio.ServicerContext) -> str:
    return grpc_utils.request_id_of(context)


@dataclass
class Failure:
    """A scripted gRPC error: ``code`` with an optional ``retry-after-ms`` trailer."""

    code: grpc.StatusCode
    retry_after_ms: int | None = None
    failed_hop: str | None = None  # e.g. grpc_utils.PUSH_HOP: the encoder says its push to PD failed

    async def raise_in(self, context: grpc.aio.ServicerContext) -> None:
        trailers = []
        if self.retry_after_ms is not None:
            trailers.append((grpc_utils.RETRY_AFTER_KEY, str(self.retry_after_ms)))
        if self.failed_hop is not None:
            trailers.append((grpc_utils.FAILED_HOP_KEY, self.failed_hop))
        if trailers:
            context.set_trailing_metadata(tuple(trailers))
        await context.abort(self.code, "scripted failure")


class FakePd(epd_pb2_grpc.PrefillDecodeServicer):
    """Test double of a PD instance: records every call, streams scripted tokens."""

    def __init__(self) -> None:
        self.address = ""
        self.preallocates: list[epd_pb2.PreallocateRequest] = []
        self.generates: list[epd_pb2.GenerateRequest] = []
        self.aborts: list[str] = []
        self.request_ids_seen: list[str] = []  # from gRPC metadata
        self.filled: set[str] = set()  # reservation ids pushed by FakeEncoder
        self.ready_hashes: set[str] = set()  # answer READY for these
        self.wait_for_pushes = True  # False: Generate streams at once (the embedding came from another push)
        self.preallocate_failure: Failure | None = None
        self.generate_failure: Failure | None = None  # before the first message
        self.fail_after_first: Failure | None = None  # after the first message
        self.hold_first_token = asyncio.Event()  # cleared = Generate waits before its first token
        self.hold_first_token.set()
        self.hold_after_first = asyncio.Event()  # cleared = Generate pauses after its first message
        self.hold_after_first.set()
        self.hold_abort = asyncio.Event()  # cleared = Abort is recorded, then hangs (a hung PD)
        self.hold_abort.set()
        self.pieces = ["Hello", " world", "!"]
        self.finish_reason = epd_pb2.FINISH_REASON_STOP
        self.num_active = 0  # Generate calls in progress
        self.generate_cancelled = 0
        self.deadlines: list[float | None] = []  # time_remaining() seen by each Generate
        self.load = epd_pb2.PdLoad()  # what GetLoad answers
        self._filled_changed = asyncio.Event()

    def fill(self, reservation_id: str) -> None:
        self.filled.add(reservation_id)
        self._filled_changed.set()

    async def Preallocate(self, request, context):
        self.preallocates.append(request)
        self.request_ids_seen.append(metadata_request_id(context))
        if self.preallocate_failure is not None:
            await self.preallocate_failure.raise_in(context)
        items = []
        for index, item in enumerate(request.items):
            state = (
                epd_pb2.ItemAllocation.READY if item.mm_hash in self.ready_hashes else epd_pb2.ItemAllocation.RESERVED
            )
            items.append(
                epd_pb2.ItemAllocation(
                    mm_hash=item.mm_hash,
                    state=state,
                    reservation_id=f"{request.request_id}/res{index}",
                )
            )
        return epd_pb2.PreallocateResponse(items=items, lease_ms=request.lease_ms)

    def _reserved_ids(self, request_id: str) -> set[str]:
        for pre in self.preallocates:
            if pre.request_id == request_id:
                return {
                    f"{request_id}/res{i}" for i, item in enumerate(pre.items) if item.mm_hash not in self.ready_hashes
                }
        return set()

    async def Generate(self, request, context):
        self.generates.append(request)
        self.deadlines.append(context.time_remaining())
        self.request_ids_seen.append(metadata_request_id(context))
        self.num_active += 1
        try:
            if self.generate_failure is not None:
                await self.generate_failure.raise_in(context)
            needed = self._reserved_ids(request.request_id)
            while self.wait_for_pushes and not needed <= self.filled:  # wait for the encoder's pushes
                self._filled_changed.clear()
                await self._filled_changed.wait()
            await self.hold_first_token.wait()
            for index, piece in enumerate(self.pieces[:-1]):
                yield epd_pb2.GenerateResponse(
                    token_ids=[10 + index], text=piece, logprobs=self._logprobs(request, 10 + index)
                )
                await self.hold_after_first.wait()
                if self.fail_after_first is not None:
                    await self.fail_after_first.raise_in(context)
            usage = epd_pb2.Usage(
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=len(self.pieces),
                cached_tokens=0,
                image_tokens=sum(item.num_tokens for item in request.mm_items),
            )
            last = 10 + len(self.pieces)
            yield epd_pb2.GenerateResponse(
                token_ids=[last],
                text=self.pieces[-1],
                finish_reason=self.finish_reason,
                usage=usage,
                logprobs=self._logprobs(request, last),
            )
        except asyncio.CancelledError:
            self.generate_cancelled += 1
            raise
        finally:
            self.num_active -= 1

    @staticmethod
    def _logprobs(request, token_id: int) -> list[epd_pb2.TokenLogprob]:
        """As PD answers: one entry per token when asked, with ``sampling.logprobs`` alternatives."""
        if not request.sampling.HasField("logprobs"):
            return []
        top = list(range(token_id, token_id + request.sampling.logprobs))
        return [
            epd_pb2.TokenLogprob(
                token_id=token_id, logprob=-0.5, top_token_ids=top, top_logprobs=[-0.5 - i for i in range(len(top))]
            )
        ]

    async def Abort(self, request, context):
        self.aborts.append(request.request_id)
        await self.hold_abort.wait()
        return epd_pb2.AbortResponse()

    async def GetLoad(self, request, context):
        return self.load


class FakeEncoder(epd_pb2_grpc.EncoderServicer):
    """Test double of an encoder: records Encode calls and fills the PD's reservations."""

    def __init__(self, pds_by_address: dict[str, FakePd]) -> None:
        self.address = ""
        self.pds_by_address = pds_by_address
        self.encodes: list[epd_pb2.EncodeRequest] = []
        self.failure: Failure | None = None  # every call fails
        self.next_failures: list[Failure] = []  # the next calls fail, one each
        self.delay_s = 0.0
        self.cancelled = 0
        self.cache_hits: set[str] = set()  # mm_hashes to report as cache hits
        self.push_failures: dict[str, Failure] = {}  # PD address -> how pushes to it fail
        self.deadlines: list[float | None] = []  # time_remaining() seen by each Encode
        self.hold = asyncio.Event()  # cleared = Encode waits (after it is recorded) until it is set
        self.hold.set()
        self.num_answered = 0  # Encode calls that got past ``hold`` and the delay

    async def Encode(self, request, context):
        self.encodes.append(request)
        self.deadlines.append(context.time_remaining())
        try:
            await self.hold.wait()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.num_answered += 1
        if self.next_failures:
            await self.next_failures.pop(0).raise_in(context)
        if self.failure is not None:
            await self.failure.raise_in(context)
        if request.pd_address in self.push_failures:
            await self.push_failures[request.pd_address].raise_in(context)
        pd = self.pds_by_address[request.pd_address]
        for item in request.items:
            has_file = item.image_file or item.video_file or item.frame_files
            assert has_file and not item.HasField("pixel_values")  # the proxy sends the client's file
            pd.fill(item.reservation_id)
        return epd_pb2.EncodeResponse(
            items=[
                epd_pb2.EncodeItemResult(mm_hash=i.mm_hash, encode_ms=1.0, cache_hit=i.mm_hash in self.cache_hits)
                for i in request.items
            ]
        )


@dataclass
class Cluster:
    """Running doubles plus a started proxy app and an HTTP client for it."""

    pds: list[FakePd]
    encoders: list[FakeEncoder]
    servers: list[grpc_utils.GrpcServer]
    client: httpx.AsyncClient | None = None
    app: object | None = None
    base_url: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def pd(self) -> FakePd:
        return self.pds[0]

    @property
    def encoder(self) -> FakeEncoder:
        return self.encoders[0]


async def serve_pd(pd: FakePd, host: str = "127.0.0.1", port: int = 0) -> grpc_utils.GrpcServer:
    """Serves ``pd`` (ready) on ``host:port``; also used to bring a stopped double back on its old port."""
    server = await grpc_utils.start_server(
        host, port, "epd.v1.PrefillDecode", lambda s: epd_pb2_grpc.add_PrefillDecodeServicer_to_server(pd, s)
    )
    await server.set_ready(True)
    pd.address = f"{host}:{server.port}"
    return server


async def serve_encoder(encoder: FakeEncoder, host: str = "127.0.0.1", port: int = 0) -> grpc_utils.GrpcServer:
    server = await grpc_utils.start_server(
        host, port, "epd.v1.Encoder", lambda s: epd_pb2_grpc.add_EncoderServicer_to_server(encoder, s)
    )
    await server.set_ready(True)
    encoder.address = f"{host}:{server.port}"
    return server


async def start_doubles(num_pds: int = 1, num_encoders: int = 1) -> Cluster:
    pds = [FakePd() for _ in range(num_pds)]
    by_address: dict[str, FakePd] = {}
    servers = []
    for pd in pds:
        server = await serve_pd(pd)
        by_address[pd.address] = pd
        servers.append(server)
    encoders = [FakeEncoder(by_address) for _ in range(num_encoders)]
    for encoder in encoders:
        servers.append(await serve_encoder(encoder))
    return Cluster(pds=pds, encoders=encoders, servers=servers)


def proxy_config(model_dir, cluster: Cluster, **overrides) -> ProxyConfig:
    return ProxyConfig(
        model=str(model_dir),
        port=0,
        pd_addresses=tuple(pd.address for pd in cluster.pds),
        encoder_addresses=tuple(e.address for e in cluster.encoders),
        served_model_name="tiny-llava",
        request_timeout_s=overrides.pop("request_timeout_s", 10.0),
        load_poll_s=overrides.pop("load_poll_s", 0.05),
        **overrides,
    )


def png_data_url(color=(200, 30, 30), size=(40, 30)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(*urls: str, text: str = "What is in these images?") -> dict:
    content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"role": "user", "content": content}


async def wait_until(predicate, timeout: float = 5.0) -> None:
    """Polls ``predicate`` until true; AssertionError after ``timeout`` seconds."""
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


def openai_client(cluster: Cluster) -> openai.AsyncOpenAI:
    """The official SDK against a cluster served over real HTTP (``cluster_factory(http=True)``)."""
    return openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
