"""The push data path (PushEmbedding and PushKV) without extra copies of the payload bytes.

A push is MiBs (an image's embedding) to hundreds of MiBs (a prompt's KV),
so every copy of it shows in hand-off latency. With the generated stubs, a
1 MiB data chunk is copied three times on the way out (slice, message field,
serialization) and once or twice more on the way in (the message's ``bytes``
field, each time it is read) before PD copies it into its buffer. Here, for
both push methods:

- the sender writes each data chunk as its encoded chunk message (field tag,
  length, payload: one copy, ``encode_data_chunk`` / ``iter_data_chunks``)
  through ``push_call``;
- PD's push handlers (``add_prefill_decode_servicer``) get a data chunk as a
  ``memoryview`` of the received message, and anything else (the header, or
  any message that is not exactly one ``data`` field) as the parsed chunk
  message; ``data_of`` reads the payload of either.

``PushEmbeddingChunk`` and ``PushKVChunk`` have the same layout (``oneof kind
{ header = 1; bytes data = 2 }``), so one encoding serves both. The bytes on
the wire are the ``epd.v1`` protocol's, unchanged: a peer using the generated
stubs on either side interoperates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from services.common.pb import epd_pb2
from services.common.wire import CHUNK_BYTES

SERVICE = epd_pb2.DESCRIPTOR.services_by_name["PrefillDecode"]
PUSH_CHUNKS: dict[str, Any] = {"PushEmbedding": epd_pb2.PushEmbeddingChunk, "PushKV": epd_pb2.PushKVChunk}
"""The push methods this module speeds up, and their chunk message."""
PUSH_METHOD = f"/{SERVICE.full_name}/PushEmbedding"
PUSH_KV_METHOD = f"/{SERVICE.full_name}/PushKV"


def _data_tag() -> bytes:
    numbers = {chunk.DESCRIPTOR.fields_by_name["data"].number for chunk in PUSH_CHUNKS.values()}
    if len(numbers) != 1:  # pragma: no cover - a proto change that this module would have to follow
        raise RuntimeError("the push chunks' data fields differ")
    return bytes([(numbers.pop() << 3) | 2])  # wire type 2 (length-delimited)


_DATA_TAG = _data_tag()

_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def encode_data_chunk(payload: memoryview | bytes) -> bytes:
    """The serialized ``PushEmbeddingChunk(data=payload)`` (equally ``PushKVChunk(data=payload)``)."""
    return b"".join((_DATA_TAG, _varint(len(payload)), payload))


def iter_data_chunks(payload: memoryview, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """``payload`` as encoded data chunks of at most ``chunk_bytes`` each, encoded as they are taken."""
    for start in range(0, len(payload), chunk_bytes):
        yield encode_data_chunk(payload[start : start + chunk_bytes])


def serialize_chunk(chunk: Any) -> bytes:
    """Request serializer of ``push_call``: pre-encoded bytes pass through, messages are serialized."""
    return chunk if isinstance(chunk, bytes) else chunk.SerializeToString()


def chunk_deserializer(message_type: Any) -> Callable[[bytes], Any]:
    """Request deserializer of a push method: a data-only chunk as a view of the received bytes,
    anything else parsed as ``message_type``."""

    def deserialize(raw: bytes) -> Any:
        if raw[:1] == _DATA_TAG:
            length, shift, index = 0, 0, 1
            while index < len(raw) and shift < 64:
                byte = raw[index]
                length |= (byte & 0x7F) << shift
                index += 1
                shift += 7
                if not byte & 0x80:
                    if index + length == len(raw):
                        return memoryview(raw)[index:]
                    break
        return message_type.FromString(raw)

    deserialize.__name__ = deserialize.__qualname__ = f"deserialize_{message_type.DESCRIPTOR.name}"
    return deserialize


deserialize_chunk = chunk_deserializer(epd_pb2.PushEmbeddingChunk)
"""PushEmbedding's request deserializer: ``memoryview | PushEmbeddingChunk``."""
deserialize_kv_chunk = chunk_deserializer(epd_pb2.PushKVChunk)
"""PushKV's request deserializer: ``memoryview | PushKVChunk``."""
_DESERIALIZERS = {"PushEmbedding": deserialize_chunk, "PushKV": deserialize_kv_chunk}


def data_of(chunk: Any) -> memoryview | bytes | None:
    """The payload of a received data chunk (a view from ``chunk_deserializer``, or a parsed chunk
    message's ``data``, read once), or None for anything else (a header, an empty message)."""
    if isinstance(chunk, memoryview):
        return chunk
    return chunk.data if chunk.WhichOneof("kind") == "data" else None


def push_call(channel: grpc.aio.Channel, method: str = "PushEmbedding") -> grpc.aio.StreamUnaryMultiCallable:
    """``method`` (a key of ``PUSH_CHUNKS``) on ``channel``, taking pre-encoded chunks
    (``encode_data_chunk``) or messages, as a request iterator or through ``write``."""
    if method not in PUSH_CHUNKS:
        raise ValueError(f"{method} is not a push method")
    response_type = getattr(epd_pb2, SERVICE.methods_by_name[method].output_type.name)
    return channel.stream_unary(
        f"/{SERVICE.full_name}/{method}",
        request_serializer=serialize_chunk,
        response_deserializer=response_type.FromString,
    )


def add_prefill_decode_servicer(servicer: object, server: grpc.aio.Server) -> None:
    """Registers every ``epd.v1.PrefillDecode`` method, the push methods with ``chunk_deserializer``.

    Built from the service descriptor, so a method added to the proto is
    registered like the generated ``add_PrefillDecodeServicer_to_server`` would.
    """
    handlers = {}
    for method in SERVICE.methods:
        request_type = getattr(epd_pb2, method.input_type.name)
        response_type = getattr(epd_pb2, method.output_type.name)
        factory = _HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=_DESERIALIZERS.get(method.name, request_type.FromString),
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
