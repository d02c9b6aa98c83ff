"""Pushes through the real ``PushEmbedding`` servicer without gRPC, for the reservation state machine.

``PushClient`` builds a push the way the encoder's pusher does (a header,
then raw chunks), optionally damaged, and runs the servicer on it inline:
the servicer assembles and validates the payload, then calls the engine
method it uses, which ``InlineBridge`` runs directly on the real
``EngineCore`` (no engine thread). The result is the status the call ended with.
"""

from __future__ import annotations

import asyncio

import grpc
import torch

from services.common import tensors
from services.common.pb import epd_pb2
from services.pd.config import PdConfig
from services.pd.engine.core import EngineCore
from services.pd.servicer import PrefillDecodeServicer

PUSH_MODES = ("complete", "truncated", "extra_bytes", "wrong_rows", "wrong_request", "no_header", "unknown_id")
"""How a push is sent: whole, or damaged in one way (``unknown_id``: to an id never issued)."""


class ContextDouble:
    """Stands in for a gRPC servicer context: ``abort`` raises, like grpc.aio's."""

    class Aborted(Exception):
        def __init__(self, code: grpc.StatusCode) -> None:
            super().__init__(code.name)
            self.code = code

    def invocation_metadata(self):
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def set_trailing_metadata(self, metadata) -> None:
        pass

    async def abort(self, code, details):
        raise self.Aborted(code)


class InlineBridge:
    """Stands in for ``EngineBridge``: the call the push servicer makes, run inline on the core."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.hidden_size = core.hidden_size
        self.num_deepstack_levels = core.num_deepstack_levels

    async def push(self, request_id, reservation_id, mm_hash, embedding):
        return self.core.fill(request_id, reservation_id, mm_hash, embedding)


class PushClient:
    """Sends pushes of ``[rows, hidden_size]`` float32 rows, every row element = ``tag``."""

    def __init__(self, core: EngineCore) -> None:
        self.hidden_size = core.hidden_size
        self.servicer = PrefillDecodeServicer(
            InlineBridge(core), PdConfig(model="unused"), eos_token_ids=(), vocab_size=16, max_model_len=64
        )
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.close()

    def push(
        self, request_id: str, reservation_id: str, mm_hash: str, rows: int, mode: str, tag: float
    ) -> grpc.StatusCode | None:
        """Runs one push; None when it was accepted, else the status code it was refused with."""
        if mode == "wrong_rows":
            rows += 1
        data = bytes(tensors.tensor_bytes(torch.full((rows, self.hidden_size), tag, dtype=torch.float32)))
        header = epd_pb2.EmbeddingHeader(
            request_id="r-other" if mode == "wrong_request" else request_id,
            reservation_id="never-issued" if mode == "unknown_id" else reservation_id,
            mm_hash=mm_hash,
            dtype=tensors.dtype_to_pb(torch.float32),
            shape=[rows, self.hidden_size],
            num_bytes=len(data),
        )
        if mode == "truncated":
            data = data[: len(data) // 2]
        elif mode == "extra_bytes":
            data += b"\0" * 4
        chunks = [] if mode == "no_header" else [epd_pb2.PushEmbeddingChunk(header=header)]
        half = len(data) // 2
        chunks += [epd_pb2.PushEmbeddingChunk(data=part) for part in (data[:half], data[half:]) if part]
        try:
            self.loop.run_until_complete(self._call(chunks))
        except ContextDouble.Aborted as aborted:
            return aborted.code
        return None

    async def _call(self, chunks: list[epd_pb2.PushEmbeddingChunk]) -> None:
        async def stream():
            for chunk in chunks:
                yield chunk

        messages = stream()
        try:
            await self.servicer.PushEmbedding(messages, ContextDouble())
        finally:
            await messages.aclose()  # grpc closes the request stream of an aborted call
