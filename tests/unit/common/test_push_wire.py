"""push_wire: the copy-saving PushEmbedding / PushKV encoding is byte-for-byte the protobuf one, both ways."""

from __future__ import annotations

import pytest

from services.common import push_wire
from services.common.pb import epd_pb2


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16_383, 16_384, 1 << 20])
def test_a_data_chunk_encodes_exactly_as_protobuf_does(size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    encoded = push_wire.encode_data_chunk(memoryview(payload))
    assert encoded == epd_pb2.PushEmbeddingChunk(data=payload).SerializeToString()


@pytest.mark.parametrize("size", [1, 200, 1 << 20])
def test_a_data_chunk_decodes_to_a_view_of_its_payload(size):
    payload = b"\x07" * size
    decoded = push_wire.deserialize_chunk(epd_pb2.PushEmbeddingChunk(data=payload).SerializeToString())
    assert isinstance(decoded, memoryview)
    assert decoded.tobytes() == payload


def test_anything_but_a_lone_data_field_is_parsed_as_a_message():
    header = epd_pb2.PushEmbeddingChunk(header=epd_pb2.EmbeddingHeader(request_id="r", num_bytes=4))
    decoded = push_wire.deserialize_chunk(header.SerializeToString())
    assert decoded.WhichOneof("kind") == "header" and decoded.header.request_id == "r"
    # Two data fields in one message (protobuf keeps the last): not a lone field, so parsed.
    doubled = push_wire.encode_data_chunk(b"ab") + push_wire.encode_data_chunk(b"cd")
    assert push_wire.deserialize_chunk(doubled).data == b"cd"
    # An empty message, and a data field with trailing unknown bytes.
    assert push_wire.deserialize_chunk(b"").WhichOneof("kind") is None
    trailing = push_wire.encode_data_chunk(b"xy") + bytes([(9 << 3) | 0, 1])
    assert push_wire.deserialize_chunk(trailing).data == b"xy"


@pytest.mark.parametrize("size", [0, 1, 300, 1 << 20])
def test_a_kv_data_chunk_encodes_and_decodes_as_protobuf_does(size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    encoded = push_wire.encode_data_chunk(memoryview(payload))
    assert encoded == epd_pb2.PushKVChunk(data=payload).SerializeToString()
    decoded = push_wire.deserialize_kv_chunk(encoded)
    assert isinstance(decoded, memoryview) and decoded.tobytes() == payload
    assert push_wire.data_of(decoded) is decoded


def test_a_kv_header_is_parsed_as_a_push_kv_chunk():
    header = epd_pb2.PushKVChunk(header=epd_pb2.KVHeader(request_id="r", shape=[2, 1, 1, 1, 4, 8], num_bytes=256))
    decoded = push_wire.deserialize_kv_chunk(header.SerializeToString())
    assert isinstance(decoded, epd_pb2.PushKVChunk)
    assert decoded.header.shape == [2, 1, 1, 1, 4, 8] and push_wire.data_of(decoded) is None
    assert push_wire.data_of(epd_pb2.PushKVChunk()) is None  # an empty message is no data chunk
    assert push_wire.data_of(epd_pb2.PushKVChunk(data=b"ab")) == b"ab"


def test_iter_data_chunks_splits_and_encodes_the_payload():
    payload = memoryview(bytes(range(256)) * 10)
    chunks = list(push_wire.iter_data_chunks(payload, 1000))
    assert [len(push_wire.deserialize_kv_chunk(c)) for c in chunks] == [1000, 1000, 560]
    assert b"".join(epd_pb2.PushKVChunk.FromString(c).data for c in chunks) == payload.tobytes()
    assert list(push_wire.iter_data_chunks(memoryview(b""))) == []


def test_a_truncated_chunk_is_a_decode_error():
    encoded = push_wire.encode_data_chunk(b"x" * 300)
    with pytest.raises(Exception):  # noqa: B017 - protobuf's DecodeError; gRPC turns it into INTERNAL
        push_wire.deserialize_chunk(encoded[:-1])


def test_the_request_serializer_passes_encoded_bytes_and_serializes_messages():
    encoded = push_wire.encode_data_chunk(b"abc")
    assert push_wire.serialize_chunk(encoded) is encoded
    message = epd_pb2.PushEmbeddingChunk(data=b"abc")
    assert push_wire.serialize_chunk(message) == encoded


def test_every_prefill_decode_method_is_registered():
    class ServerDouble:
        def add_generic_rpc_handlers(self, handlers):
            self.generic = handlers

        def add_registered_method_handlers(self, service, handlers):
            self.service, self.handlers = service, handlers

    class ServicerDouble:
        def __getattr__(self, name):
            return lambda *args: name

    server = ServerDouble()
    push_wire.add_prefill_decode_servicer(ServicerDouble(), server)
    assert server.service == "epd.v1.PrefillDecode"
    assert set(server.handlers) == {m.name for m in push_wire.SERVICE.methods}
    push = server.handlers["PushEmbedding"]
    assert push.request_streaming and not push.response_streaming
    assert push.request_deserializer is push_wire.deserialize_chunk
    kv = server.handlers["PushKV"]
    assert kv.request_streaming and not kv.response_streaming
    assert kv.request_deserializer is push_wire.deserialize_kv_chunk
    generate = server.handlers["Generate"]
    assert not generate.request_streaming and generate.response_streaming


def test_push_call_takes_the_push_methods_only():
    class ChannelDouble:
        def stream_unary(self, method, request_serializer, response_deserializer):
            return method, request_serializer, response_deserializer

    method, serializer, deserializer = push_wire.push_call(ChannelDouble(), "PushKV")
    assert method == "/epd.v1.PrefillDecode/PushKV" and serializer is push_wire.serialize_chunk
    assert deserializer == epd_pb2.PushKVResponse.FromString
    assert push_wire.push_call(ChannelDouble())[0] == push_wire.PUSH_METHOD
    with pytest.raises(ValueError):
        push_wire.push_call(ChannelDouble(), "Generate")
