"""The KV hand-off on the wire: ReserveKV and PushKV (decode side), the push after a prefill (prefill side).

The engine keeps the books (``engine/handoff_core.py``); here the bytes move.
P copies the prompt's blocks D lacks out of its KV tensors on the engine
thread (one gather into the tensor that is sent: the blocks may be reused as
soon as that call returns), then, off the engine thread, sends it as one
``epd.v1.Tensor``-style payload (raw bytes, no pickle) in <= 1 MiB chunks and
lets its blocks go whatever the outcome. The chunks take ``push_wire``'s
path, as the embedding push does: each is encoded straight from the
tensor's memory (one copy), and D's handler gets each data chunk as a view
of the received message, copied once into its buffer. D checks the header
against its reservation before taking a buffer (the buffer is exactly the
reservation's size), reads the chunks with an idle timeout, and writes them
into the reserved blocks on the engine thread, where the reservation is
checked again (its lease may have ended while the bytes arrived). The bytes
on the wire are the protobuf encoding: generated-stub peers interoperate.

D receives pushes as it receives embedding pushes (``push_intake.py``): one
stream per reservation at a time (a second is FAILED_PRECONDITION before any
buffer), at most ``--max-pushes-per-peer`` from one caller address, their
buffers within ``--max-kv-push-buffer-mb`` together (a larger push is let in
alone), an idle timeout that only bytes move (empty chunks do not), and the
buffer allocated and the values checked off the event loop. ReserveKV
counts each reservation against its caller's share (``ReservationLimits``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from services.common import grpc_utils, push_wire, tensors
from services.common.dial_allow import PdAllowList
from services.common.pb import epd_pb2
from services.pd import convert
from services.pd.bridge import EngineBridge
from services.pd.config import PdConfig
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.kv_handoff import KVExport
from services.pd.push_intake import PushSlots, next_chunk, read_payload

log = logging.getLogger(__name__)

MAX_CHANNELS = 64
"""Decode-instance channels a prefill instance keeps open (least recently used closed first)."""
_MAX_ADDRESS_CHARS = 255
_STALLED = "the KV push sent nothing for too long"
_IN_PROGRESS = "a KV push to this reservation is already in progress"


@dataclass
class PushCounters:
    """Pushes that landed on one side: how many, their bytes, and the seconds they took."""

    num_pushes: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def add(self, num_bytes: int, seconds: float) -> None:
        self.num_pushes += 1
        self.num_bytes += num_bytes
        self.seconds += seconds


@dataclass
class KVTransferStats:
    """What ``epd_pd_kv_push_*`` reports: pushes sent (prefill side) and received (decode side)."""

    sent: PushCounters = field(default_factory=PushCounters)
    received: PushCounters = field(default_factory=PushCounters)


def _invalid(message: str) -> EngineError:
    return EngineError(ErrorKind.INVALID_ARGUMENT, message)


class KVTransfer:
    """ReserveKV / PushKV handlers and the prefill side's push; ``PrefillDecodeServicer`` delegates here."""

    def __init__(
        self,
        engine: EngineBridge,
        config: PdConfig,
        *,
        vocab_size: int,
        max_model_len: int,
        uses_grids: bool | None,
        tokens_per_second: float | None = None,
        channel_factory: Callable[[str], grpc.aio.Channel] | None = None,
        decode_allow: PdAllowList | None = None,
    ) -> None:
        """``tokens_per_second``: the model's temporal rate for video positions (as the Generate that takes
        the reservation over uses it); ``decode_allow``: the decode PDs a hand-off may name (default:
        ``config.decode_allow``)."""
        self.engine = engine
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.uses_grids = uses_grids
        self.tokens_per_second = tokens_per_second
        self._channel_factory = channel_factory or (lambda address: grpc_utils.aio_channel(address, config.security))
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, grpc.aio.StreamUnaryMultiCallable]] = OrderedDict()
        self.stats = KVTransferStats()
        self._decode_allow = decode_allow or PdAllowList(config.decode_allow)
        self.slots = PushSlots(
            config.max_kv_push_buffer_mb << 20, config.max_pushes_per_peer, oversize_alone=True
        )  # decode side: the pushes being received

    # ------------------------------------------------------------ decode side
    async def reserve(self, request: epd_pb2.ReserveKVRequest, time_remaining: float | None, peer: str = "") -> Any:
        """ReserveKV: checks the prompt, then reserves on the engine thread, counted against ``peer`` (the
        caller's address); raises EngineError."""
        convert.check_request_id(request.request_id)
        cache_salt = convert.check_cache_salt(request.cache_salt)
        convert.check_prompt(request.prompt_token_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        spans = convert.spans_from_pb(
            request.items,
            len(request.prompt_token_ids),
            max_items=self.config.max_items_per_request,
            uses_grids=self.uses_grids,
            tokens_per_second=self.tokens_per_second,  # a video's spans as its Generate's: they must match
        )
        lease_ms = min(request.lease_ms or self.config.default_lease_ms, self.config.max_lease_ms)
        if time_remaining is not None:
            lease_ms = max(1, min(lease_ms, int(time_remaining * 1000)))
        core = self.engine.core
        grant = await self.engine.call(
            core.reserve_kv,
            request.request_id,
            list(request.prompt_token_ids),
            spans,
            lease_ms / 1000,
            cache_salt,
            peer,
        )
        return epd_pb2.ReserveKVResponse(
            reservation_id=grant.reservation_id,
            num_blocks=grant.num_blocks,
            num_cached_blocks=grant.num_cached_blocks,
            block_size=grant.block_size,
            lease_ms=lease_ms,
        )

    async def receive(self, chunks: AsyncIterator[Any], peer: str = "") -> int:
        """PushKV: reads one push into its reservation; returns its payload bytes; raises EngineError.

        ``chunks``: ``PushKVChunk`` messages, or data chunks as views (``push_wire.deserialize_kv_chunk``);
        ``peer``: the caller's address (its pushes in flight are bounded)."""
        stream = aiter(chunks)
        idle_s = self.config.push_idle_timeout_s
        first = await next_chunk(stream, time.monotonic() + idle_s, _STALLED)
        started = time.perf_counter()
        if first is None or push_wire.data_of(first) is not None or first.WhichOneof("kind") != "header":
            raise _invalid("a KV push must start with its header")
        header = first.header
        convert.check_request_id(header.request_id)
        first_token = convert.first_token_from_pb(header, self.vocab_size)
        runner = self.engine.core.runner
        if len(header.shape) != 6:
            raise _invalid("a KV push's shape has six dimensions")
        shape = runner.kv_push_shape(int(header.shape[3]))
        try:
            dtype = tensors.dtype_from_pb(header.dtype)
        except ValueError:
            raise _invalid("unknown dtype") from None
        if tuple(header.shape) != shape or dtype != runner.dtype:
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "the KV push's shape or dtype differs from this server's")
        num_bytes = tensors.expected_num_bytes(dtype, shape)
        if header.num_bytes != num_bytes:
            raise _invalid("num_bytes does not match the shape")
        core, ids = self.engine.core, (header.request_id, header.reservation_id)
        with self.slots.hold(header.reservation_id, peer, _IN_PROGRESS) as slot:
            targets = await self.engine.call(core.kv_push_targets, *ids, shape[3])  # refused before any buffer
            slot.take_buffer(num_bytes)
            buffer = await asyncio.to_thread(bytearray, num_bytes)  # zeroing GiBs stalls no other call
            await read_payload(stream, num_bytes, buffer, idle_s, _STALLED, ErrorKind.INVALID_ARGUMENT)
            kv = tensors.tensor_from_bytes(buffer, dtype, shape)
            if not await asyncio.to_thread(tensors.all_finite, kv):
                raise _invalid("the KV push holds non-finite values")

            def land() -> None:  # on the engine thread: the reservation is checked again, then written
                if core.kv_push_targets(*ids, shape[3]) != targets:
                    raise EngineError(ErrorKind.FAILED_PRECONDITION, "the KV reservation changed during the push")
                runner.write_kv_blocks(targets, kv)
                core.fill_kv(*ids, first_token)

            await self.engine.call(land)
        self.stats.received.add(num_bytes, time.perf_counter() - started)
        return num_bytes

    # ----------------------------------------------------------- prefill side
    async def push(
        self,
        request_id: str,
        handoff: epd_pb2.KVHandoff,
        timeout_s: float | None,
        first_logprob: epd_pb2.TokenLogprob | None = None,
    ) -> None:
        """Pushes a finished prefill's K/V (after ``handoff.num_cached_blocks``) and its first token to the
        decode instance; lets the held blocks go whatever happens. Raises EngineError (UNAVAILABLE, or
        the decode instance's refusal)."""
        core = self.engine.core
        try:
            await self.check_target(handoff)
            started = time.perf_counter()

            def read() -> tuple[KVExport, torch.Tensor]:  # one engine-thread call: an Abort cannot come between
                export = core.take_export(request_id)
                if export is None:
                    raise EngineError(ErrorKind.UNAVAILABLE, "the prefilled KV is no longer held for its push")
                if handoff.num_cached_blocks >= len(export.block_ids):
                    raise _invalid("num_cached_blocks leaves nothing to push")
                # The engine thread only copies the blocks out (into the CPU tensor that is sent);
                # encoding and sending happen here, on the event loop.
                return export, core.runner.read_kv_blocks(export.block_ids[handoff.num_cached_blocks :])

            export, kv = await self.engine.call(read)
            payload = tensors.tensor_bytes(kv)  # a view of kv's memory (a CPU tensor: no copy)
            header = epd_pb2.KVHeader(
                request_id=request_id,
                reservation_id=handoff.reservation_id,
                dtype=tensors.dtype_to_pb(kv.dtype),
                shape=list(kv.shape),
                num_bytes=len(payload),
                first_token_id=export.first_token_id,
                first_token_logprob=first_logprob,
            )
            await self._send(handoff.address, header, payload, timeout_s)
            self.stats.sent.add(len(payload), time.perf_counter() - started)
        finally:
            try:
                await self.engine.call(core.release_export, request_id)
            except EngineError:
                pass  # the engine is stopping: its blocks go with it

    async def check_target(self, handoff: epd_pb2.KVHandoff) -> None:
        """Refuses (PERMISSION_DENIED) a decode PD outside ``--decode-allow``: the address decides where
        this PD, and its token, go. Checked before the prefill is admitted, and again before the push."""
        if not await self._decode_allow.allows(handoff.address):
            raise EngineError(ErrorKind.PERMISSION_DENIED, "kv_handoff.address is not allowed (--decode-allow)")

    async def _send(self, address: str, header: epd_pb2.KVHeader, payload: memoryview, timeout_s: float | None) -> None:
        def chunks() -> Iterator[epd_pb2.PushKVChunk | bytes]:  # each data chunk encoded as it is sent
            yield epd_pb2.PushKVChunk(header=header)
            yield from push_wire.iter_data_chunks(payload)

        try:
            await self._push_call(address)(chunks(), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            log.warning("KV push to a decode instance failed: %s", error.code().name)
            kind = _KINDS.get(error.code(), ErrorKind.UNAVAILABLE)
            raise EngineError(kind, "the KV push to the decode instance failed") from None

    def _push_call(self, address: str) -> grpc.aio.StreamUnaryMultiCallable:
        if not address or len(address) > _MAX_ADDRESS_CHARS or address.count(":") < 1:
            raise _invalid("kv_handoff.address must be host:port")
        if address in self._channels:
            self._channels.move_to_end(address)
            return self._channels[address][1]
        channel = self._channel_factory(address)
        self._channels[address] = (channel, push_wire.push_call(channel, "PushKV"))
        while len(self._channels) > MAX_CHANNELS:
            _, (old, _) = self._channels.popitem(last=False)
            asyncio.get_running_loop().create_task(old.close())
        return self._channels[address][1]

    async def close(self) -> None:
        """Closes the channels to decode instances."""
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()


# A decode instance's refusal keeps its meaning for the caller (a lease that ran out is a timeout);
# anything else is the hop being unavailable.
_KINDS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND: ErrorKind.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorKind.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.FAILED_PRECONDITION,
}
