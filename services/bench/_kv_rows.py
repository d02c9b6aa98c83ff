"""``epd bench transfer --kv``: a prompt's KV push from a prefill PD to a decode PD, against its prefill.

Two real PDs of one checkpoint (``--kv-model``, default the ``bench`` preset:
12 layers, 12 KV heads of 64) in this process, on loopback gRPC: one
``--role prefill``, one ``--role decode``. Per prompt length: ReserveKV on the
decode PD, then the prefill PD's Generate with the hand-off, which prefills,
samples the first token and pushes the prompt's KV. The push time is the
prefill PD's own (read of the blocks, send, and the decode PD's write,
``epd_pd_kv_push_seconds_total``); the prefill time is the rest of that
Generate. Each prompt is new (no prefix-cache hit on either side); the
reservation is then aborted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from typing import Any

DEFAULT_TOKENS = "128,512,1024,2048,4096"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv", action="store_true", help="measure the KV hand-off instead (see --kv-*)")
    parser.add_argument("--kv-model", default="bench", help="checkpoint or preset of both PDs (default: bench)")
    parser.add_argument("--kv-tokens", default=DEFAULT_TOKENS, help=f"prompt lengths (default: {DEFAULT_TOKENS})")
    parser.add_argument("--kv-repeats", type=int, default=3, help="timed prompts per length (default: 3)")


async def _one(prefill: Any, decode: Any, stubs: tuple[Any, Any], num_tokens: int, vocab: int) -> tuple[float, float]:
    """(prefill seconds, push seconds) of one fresh prompt."""
    from services.common.pb import epd_pb2

    prefill_stub, decode_stub = stubs
    request_id = f"kvbench-{uuid.uuid4().hex}"
    prompt = [random.randrange(3, vocab) for _ in range(num_tokens)]
    pushed_before = prefill.servicer.kv.stats.sent.seconds
    started = time.perf_counter()
    grant = await decode_stub.ReserveKV(epd_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt))
    handoff = epd_pb2.KVHandoff(address=decode.address, reservation_id=grant.reservation_id)
    sampling = epd_pb2.SamplingParams(temperature=0.0, max_tokens=1)
    call = prefill_stub.Generate(
        epd_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling, kv_handoff=handoff)
    )
    async for _ in call:
        pass
    total = time.perf_counter() - started
    await decode_stub.Abort(epd_pb2.AbortRequest(request_id=request_id))
    push = prefill.servicer.kv.stats.sent.seconds - pushed_before
    return total - push, push


async def _measure(args: argparse.Namespace, lengths: list[int]) -> list[dict[str, Any]]:
    import grpc

    from services.common.pb import epd_pb2_grpc
    from services.pd.config import PdConfig
    from services.pd.server import start_pd

    common = {"model": args.kv_model, "host": "127.0.0.1", "port": 0, "max_model_len": max(lengths) + 1}
    prefill = await start_pd(PdConfig(**common, role="prefill", max_num_batched_tokens=max(lengths)))
    decode = await start_pd(PdConfig(**common, role="decode"))
    rows = []
    try:
        async with grpc.aio.insecure_channel(prefill.address) as p, grpc.aio.insecure_channel(decode.address) as d:
            stubs = (epd_pb2_grpc.PrefillDecodeStub(p), epd_pb2_grpc.PrefillDecodeStub(d))
            assert prefill.servicer is not None  # start_pd always attaches one
            vocab = prefill.servicer.vocab_size
            runner = prefill.engine.core.runner
            await _one(prefill, decode, stubs, min(lengths), vocab)  # warm-up
            for num_tokens in lengths:
                timed = [await _one(prefill, decode, stubs, num_tokens, vocab) for _ in range(args.kv_repeats)]
                num_blocks = -(-num_tokens // runner.block_size)
                num_bytes = num_blocks * runner.key_cache[:, :, :1].numel() * 2 * runner.key_cache.element_size()
                prefill_ms = statistics.median(t[0] for t in timed) * 1000
                push_ms = statistics.median(t[1] for t in timed) * 1000
                rows.append(
                    {
                        "tokens": num_tokens,
                        "kv_mb": num_bytes / 1e6,
                        "prefill_ms": prefill_ms,
                        "push_ms": push_ms,
                        "push_over_prefill": push_ms / prefill_ms,
                        "gb_per_s": num_bytes / 1e9 / (push_ms / 1000),
                    }
                )
    finally:
        await prefill.stop(0)
        await decode.stop(0)
    return rows


def run(args: argparse.Namespace) -> int:
    try:
        lengths = sorted({int(part) for part in args.kv_tokens.split(",") if part.strip()})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] <= 0 or args.kv_repeats <= 0:
        print("epd bench transfer --kv: need positive --kv-tokens and --kv-repeats")
        return 2
    rows = asyncio.run(_measure(args, lengths))
    print(f"KV hand-off, prefill PD -> decode PD ({args.kv_model}, one process, loopback gRPC, medians)")
    print(f"  {'tokens':>6} {'KV MB':>7} {'prefill ms':>10} {'push ms':>8} {'push/prefill':>12} {'GB/s':>6}")
    for row in rows:
        print(
            f"  {row['tokens']:6d} {row['kv_mb']:7.2f} {row['prefill_ms']:10.1f} {row['push_ms']:8.1f} "
            f"{row['push_over_prefill']:12.3f} {row['gb_per_s']:6.2f}"
        )
    result = {"benchmark": "transfer-kv", "model": args.kv_model, "rows": rows}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
    return 0
