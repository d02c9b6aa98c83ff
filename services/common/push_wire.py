"""The PushEmbedding data path without extra copies of the embedding bytes.

A push is a few MiB per image, so every copy of it shows in hand-off latency.
With the generated stubs, a 1 MiB data chunk is copied three times on the
way out (slice, message field, serialization) and once more on the way in
(the message's ``bytes`` field) before PD copies it into its buffer. Here:

- the sender writes each data chunk as its encoded ``PushEmbeddingChunk``
  (field tag, length, payload: one copy) through ``push_call``;
- PD's ``PushEmbedding`` handler (``add_prefill_decode_servicer``) gets a
  data chunk as a ``memoryview`` of the received message, and anything else
  (the header, or any message that is not exactly one ``data`` field) as a
  parsed ``PushEmbeddingChunk``.

The bytes on the wire are the ``epd.v1`` protocol's, unchanged: a peer using
the generated stubs on either side interoperates.
"""

from __future__ import annotations

import grpc

from services.common.pb import epd_pb2

SERVICE = epd_pb2.DESCRIPTOR.services_by_name["PrefillDecode"]
PUSH_METHOD = f"/{SERVICE.full_name}/PushEmbedding"
_DATA_TAG = bytes([(2 << 3) | 2])  # field 2 (``data``), wire type 2 (length-delimited)

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
    """The serialized ``PushEmbeddingChunk(data=payload)``."""
    return b"".join((_DATA_TAG, _varint(len(payload)), payload))


def serialize_chunk(chunk: bytes | epd_pb2.PushEmbeddingChunk) -> bytes:
    """Request serializer of ``push_call``: pre-encoded bytes pass through, messages are serialized."""
    return chunk if isinstance(chunk, bytes) else chunk.SerializeToString()


def deserialize_chunk(raw: bytes) -> memoryview | epd_pb2.PushEmbeddingChunk:
    """Request deserializer of PD's PushEmbedding: a data-only chunk as a view of ``raw``, else the message."""
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
    return epd_pb2.PushEmbeddingChunk.FromString(raw)


def push_call(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryMultiCallable:
    """PushEmbedding on ``channel``, taking pre-encoded chunks (``encode_data_chunk``) or messages."""
    return channel.stream_unary(
        PUSH_METHOD,
        request_serializer=serialize_chunk,
        response_deserializer=epd_pb2.PushEmbeddingResponse.FromString,
    )


def add_prefill_decode_servicer(servicer: object, server: grpc.aio.Server) -> None:
    """Registers every ``epd.v1.PrefillDecode`` method, PushEmbedding with ``deserialize_chunk``.

    Built from the service descriptor, so a method added to the proto is
    registered like the generated ``add_PrefillDecodeServicer_to_server`` would.
    """
    handlers = {}
    for method in SERVICE.methods:
        request_type = getattr(epd_pb2, method.input_type.name)
        response_type = getattr(epd_pb2, method.output_type.name)
        factory = _HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
        deserializer = deserialize_chunk if method.name == "PushEmbedding" else request_type.FromString
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=deserializer,
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
