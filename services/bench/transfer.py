"""Embedding hand-off throughput on loopback: the encoder's real pusher into PD's real PushEmbedding path.

What is measured, per iteration: the wall time of one ``EmbeddingPusher.push``
call in the sender process (a [tokens, hidden] tensor, default 576 x 4096
float16 = 4.7 MB, one LLaVA-1.5-7B image), from the call until PD's
acknowledgement. That covers serialising the tensor into <= 1 MiB chunks,
gRPC over loopback TCP into a second process, PD's servicer validating the
header, checking the reservation on its engine thread, reassembling the
chunks, building the tensor and filling the reservation on the engine
thread. Not measured: the vision forward and the Preallocate/Abort calls
around each push (each iteration reserves a fresh image, pushes it, aborts).

The receiver is PD's own ``PrefillDecodeServicer`` and engine core with the
real embedding cache and scheduler, built without a language model (a PD
with hidden size 4096 would need a 7B-class checkpoint); only Generate,
which this benchmark never calls, would need one.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import statistics
import time
from typing import Any

KIB = 1 << 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=50, help="timed pushes (default: 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed pushes first (default: 5)")
    parser.add_argument("--tokens", type=int, default=576, help="embedding rows (default: 576, LLaVA-1.5 336px)")
    parser.add_argument("--hidden", type=int, default=4096, help="embedding width (default: 4096, a 7B LM)")
    parser.add_argument(
        "--dtype",
        default="float16",
        choices=["float16", "bfloat16", "float32"],
        help="embedding dtype on the wire and on PD (default: float16)",
    )
    parser.add_argument("--chunk-kib", type=int, default=1024, help="push chunk size in KiB, <= 1024 (default: 1024)")
    parser.add_argument("--json", default="", help="also write the results as JSON to this path")
    from services.bench import _kv_rows

    _kv_rows.add_arguments(parser)


# ----------------------------------------------------------------------------- receiver (child process)


class PushOnlyRunner:
    """The receiver's model runner: this benchmark runs no model, so it only prepares
    pushed embeddings (as a CPU ``ModelRunner`` of this dtype does) and refuses steps."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype

    def prepare_embedding(self, embedding: Any) -> Any:
        return embedding.to(device="cpu", dtype=self.dtype)

    def execute(self, scheduler_output: Any, embeddings: Any) -> Any:
        raise RuntimeError("the transfer benchmark's receiver runs no model")


def build_receiver(hidden_size: int, dtype_name: str, capacity_tokens: int) -> tuple[Any, Any]:
    """PD's engine and servicer without a language model: everything PushEmbedding touches is real."""
    import torch

    from services.pd.bridge import EngineBridge
    from services.pd.config import PdConfig
    from services.pd.engine.core import EngineCore
    from services.pd.engine.embedding_cache import EmbeddingCache
    from services.pd.engine.kv_cache import KVCacheManager
    from services.pd.engine.scheduler import Scheduler, SchedulerConfig
    from services.pd.servicer import PrefillDecodeServicer

    scheduler = Scheduler(
        SchedulerConfig(max_model_len=capacity_tokens + 16, max_num_seqs=1),
        KVCacheManager(1, 16),
        EmbeddingCache(capacity_tokens),
    )
    core = EngineCore(
        scheduler=scheduler, runner=PushOnlyRunner(getattr(torch, dtype_name)), tokenizer=None, hidden_size=hidden_size
    )
    engine = EngineBridge(core)
    servicer = PrefillDecodeServicer(
        engine, PdConfig(model=""), eos_token_ids=(), vocab_size=1, max_model_len=capacity_tokens + 16
    )
    return engine, servicer


async def _serve(hidden_size: int, dtype_name: str, capacity_tokens: int, conn: Any) -> None:
    from services.common import grpc_utils, push_wire

    engine, servicer = build_receiver(hidden_size, dtype_name, capacity_tokens)
    engine.start()
    server = await grpc_utils.start_server(
        "127.0.0.1", 0, "epd.v1.PrefillDecode", lambda s: push_wire.add_prefill_decode_servicer(servicer, s)
    )
    await server.set_ready(True)
    conn.send(server.port)
    # "cpu" -> this process's CPU seconds so far; anything else (or EOF) = stop.
    while await asyncio.to_thread(conn.recv) == "cpu":
        conn.send(time.process_time())
    await server.stop(0)
    engine.shutdown()


def _receiver_main(hidden_size: int, dtype_name: str, capacity_tokens: int, conn: Any) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        asyncio.run(_serve(hidden_size, dtype_name, capacity_tokens, conn))
    except EOFError:
        pass


# ----------------------------------------------------------------------------- sender


async def _measure(args: argparse.Namespace, address: str) -> tuple[list[float], float]:
    """Wall seconds of each timed push, and the sender's CPU seconds over the timed pushes."""
    import torch

    from services.common import grpc_utils
    from services.common.pb import epd_pb2, epd_pb2_grpc
    from services.encoder.pusher import EmbeddingPusher

    embedding = torch.randn(args.tokens, args.hidden).to(getattr(torch, args.dtype))
    pusher = EmbeddingPusher(
        chunk_bytes=args.chunk_kib * KIB,
        max_outbound_bytes=1 << 30,
        default_timeout_s=30.0,
        max_attempts=1,
        connect_timeout_s=10.0,
    )
    channel = grpc_utils.aio_channel(address)
    stub = epd_pb2_grpc.PrefillDecodeStub(channel)
    seconds: list[float] = []
    cpu_seconds = 0.0
    try:
        for i in range(args.warmup + args.iterations):
            request_id = f"bench-{i}"
            mm_hash = hashlib.sha256(request_id.encode()).hexdigest()
            reply = await stub.Preallocate(
                epd_pb2.PreallocateRequest(
                    request_id=request_id,
                    prompt_token_ids=[0] * args.tokens,
                    items=[epd_pb2.MultiModalItem(mm_hash=mm_hash, offset=0, num_tokens=args.tokens)],
                ),
                timeout=10,
            )
            start, cpu_start = time.perf_counter(), time.process_time()
            await pusher.push(
                address,
                request_id=request_id,
                reservation_id=reply.items[0].reservation_id,
                mm_hash=mm_hash,
                embedding=embedding,
                deadline=time.monotonic() + 30.0,
            )
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            if i >= args.warmup:
                seconds.append(elapsed)
                cpu_seconds += cpu
            await stub.Abort(epd_pb2.AbortRequest(request_id=request_id), timeout=10)
    finally:
        await pusher.close()
        await channel.close()
    return seconds, cpu_seconds


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[index]


def summarize(seconds: list[float], num_bytes: int) -> dict[str, float]:
    """p50/p99/mean/min in ms and throughput at the median, in GB/s (10^9 bytes)."""
    p50 = statistics.median(seconds)
    return {
        "num_bytes": num_bytes,
        "iterations": len(seconds),
        "p50_ms": p50 * 1000,
        "p99_ms": _percentile(seconds, 99) * 1000,
        "mean_ms": statistics.fmean(seconds) * 1000,
        "min_ms": min(seconds) * 1000,
        "gb_per_s_at_p50": num_bytes / p50 / 1e9,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    if args.kv:
        from services.bench import _kv_rows

        return _kv_rows.run(args)

    if not 0 < args.chunk_kib <= 1024 or args.iterations <= 0 or args.warmup < 0:
        print("epd bench transfer: need 0 < --chunk-kib <= 1024, --iterations > 0, --warmup >= 0")
        return 2
    torch.set_num_threads(1)
    num_bytes = args.tokens * args.hidden * torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    receiver = context.Process(
        target=_receiver_main, args=(args.hidden, args.dtype, 4 * args.tokens, child), daemon=True
    )
    receiver.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the PD receiver did not start within 120 s")
        port = parent.recv()
        parent.send("cpu")
        receiver_cpu = parent.recv()
        seconds, sender_cpu = asyncio.run(_measure(args, f"127.0.0.1:{port}"))
        parent.send("cpu")
        receiver_cpu = parent.recv() - receiver_cpu
    finally:
        parent.send("stop")
        receiver.join(30)
        if receiver.is_alive():
            receiver.kill()
    result = {
        "benchmark": "transfer",
        "shape": [args.tokens, args.hidden],
        "dtype": args.dtype,
        "chunk_bytes": args.chunk_kib * KIB,
        **summarize(seconds, num_bytes),
        # CPU per timed push; the receiver's also covers warm-up, Preallocate and Abort calls.
        "sender_cpu_ms": sender_cpu / len(seconds) * 1000,
        "receiver_cpu_ms": receiver_cpu / (args.warmup + args.iterations) * 1000,
    }
    print("embedding push, encoder pusher -> PD PushEmbedding (separate processes, loopback TCP)")
    print(
        f"  payload     {args.tokens} x {args.hidden} {args.dtype} = {num_bytes / 1e6:.2f} MB, "
        f"chunks of {args.chunk_kib} KiB, {len(seconds)} timed pushes after {args.warmup} warm-up"
    )
    print(
        f"  {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'min ms':>8} {'GB/s@p50':>9} {'cpu ms send':>11} {'cpu ms recv':>11}"
    )
    print(
        f"  {result['p50_ms']:8.2f} {result['p99_ms']:8.2f} {result['mean_ms']:8.2f} "
        f"{result['min_ms']:8.2f} {result['gb_per_s_at_p50']:9.2f} "
        f"{result['sender_cpu_ms']:11.2f} {result['receiver_cpu_ms']:11.2f}"
    )
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
    return 0
