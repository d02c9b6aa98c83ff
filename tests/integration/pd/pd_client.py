"""A raw gRPC client playing proxy and encoder against PD, for the PD tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

from cluster_support import InProcessCluster

from services.common import tensors
from services.common.pb import epd_pb2


def new_request_id() -> str:
    return f"test-{uuid.uuid4().hex}"


def greedy(max_tokens: int = 8, **extra) -> epd_pb2.SamplingParams:
    return epd_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def run_generate(stub, request: epd_pb2.GenerateRequest, timeout: float = 60):
    """Runs Generate to the end; returns (token_ids, text, final message)."""
    token_ids, text, final = [], "", None
    for message in stub.Generate(request, timeout=timeout):
        token_ids += message.token_ids
        text += message.text
        if message.finish_reason:
            final = message
    return token_ids, text, final


def push_chunks(request_id, reservation_id, mm_hash, embedding, chunk_bytes=tensors.CHUNK_BYTES, extra=b""):
    """A PushEmbedding stream: header, then chunks (``extra`` bytes beyond what the header declares)."""
    payload = bytes(tensors.tensor_bytes(embedding)) + extra
    yield epd_pb2.PushEmbeddingChunk(
        header=epd_pb2.EmbeddingHeader(
            request_id=request_id,
            reservation_id=reservation_id,
            mm_hash=mm_hash,
            dtype=tensors.dtype_to_pb(embedding.dtype),
            shape=list(embedding.shape),
            num_bytes=len(payload) - len(extra),
        )
    )
    for chunk in tensors.iter_chunks(payload, chunk_bytes):
        yield epd_pb2.PushEmbeddingChunk(data=chunk)


def single_pd(model_dir, **pd) -> Iterator[InProcessCluster]:
    """One in-process PD (no encoder, no proxy) with ``pd`` config fields; a module fixture yields from it."""
    cluster = InProcessCluster(str(model_dir), num_encoders=0, with_proxy=False, pd=pd).start()
    yield cluster
    cluster.stop()
