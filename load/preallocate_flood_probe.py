"""Probe: does a flood of tiny Preallocate calls stall the streams PD is decoding?

Starts ``epd pd`` on the tiny model (no internal token: any caller is a token
holder), opens one long Generate stream, then sends 20,000 one-image
Preallocates from 64 concurrent callers on one connection, as a compromised
proxy could, and streams on while their leases run out. Prints the stream's
largest token gap before, during and after the flood, and how the calls
were answered.

    python load/preallocate_flood_probe.py        # about 80 s on two cores
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from services.bench.serve.procs import free_port
from services.common import grpc_utils
from services.common.models import ensure_model
from services.common.pb import epd_pb2, epd_pb2_grpc

NUM_CALLS = 20_000
CONCURRENCY = 64
IMAGE_TOKENS = 1  # the smallest reservation: the flood is about how many, not how big
AFTER_S = 40.0


async def stream_gaps(stub, gaps: list[tuple[float, float]]) -> None:
    """Streams to the end of the context, again and again, recording every gap between two tokens."""
    for round_ in range(1_000_000):
        request = epd_pb2.GenerateRequest(
            request_id=f"probe-stream-{round_}",
            prompt_token_ids=[5, 6, 7, 8],
            sampling=epd_pb2.SamplingParams(max_tokens=0, ignore_eos=True),
        )
        last = None
        async for _ in stub.Generate(request, timeout=600):
            now = time.monotonic()
            if last is not None:
                gaps.append((now, now - last))
            last = now


async def flood(stub, image_token: int, answers: collections.Counter) -> None:
    calls = iter(range(NUM_CALLS))

    async def caller() -> None:
        for index in calls:
            request_id = f"flood-{index}"
            items = [
                epd_pb2.MultiModalItem(
                    mm_hash=hashlib.sha256(request_id.encode()).hexdigest(), offset=1, num_tokens=IMAGE_TOKENS
                )
            ]
            prompt = [5] + [image_token] * IMAGE_TOKENS + [6]
            try:
                await stub.Preallocate(
                    epd_pb2.PreallocateRequest(request_id=request_id, prompt_token_ids=prompt, items=items), timeout=30
                )
                answers["OK"] += 1
            except grpc.aio.AioRpcError as error:
                answers[error.code().name] += 1

    await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))


async def probe(address: str, image_token: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = epd_pb2_grpc.PrefillDecodeStub(channel)
        gaps: list[tuple[float, float]] = []
        stream = asyncio.create_task(stream_gaps(stub, gaps))
        await asyncio.sleep(3.0)
        flood_started = time.monotonic()
        answers: collections.Counter = collections.Counter()
        await flood(stub, image_token, answers)
        flood_ended = time.monotonic()
        await asyncio.sleep(AFTER_S)  # the calls' leases (PD's default, 30 s) run out meanwhile
        stream.cancel()
    before = max((g for t, g in gaps if t < flood_started), default=0.0)
    during = max((g for t, g in gaps if flood_started <= t <= flood_ended), default=0.0)
    after = max((g for t, g in gaps if t > flood_ended), default=0.0)
    print(f"{NUM_CALLS} Preallocates in {flood_ended - flood_started:.1f} s: {dict(answers)}")
    print(
        f"largest token gap: {before * 1000:.0f} ms before the flood, {during * 1000:.0f} ms during it, "
        f"{after * 1000:.0f} ms in the {AFTER_S:.0f} s after it (lease expiry)"
    )


def main() -> None:
    model_dir = Path(ensure_model("tiny"))
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_index"]
    port = free_port()
    argv = [sys.executable, "-m", "services.cli", "pd", "--model", str(model_dir), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--metrics-port", "-1"]
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # Readiness, not liveness: PD reports it once its warm-up step has run.
        asyncio.run(grpc_utils.wait_healthy(f"127.0.0.1:{port}", "epd.v1.PrefillDecode", timeout=120))
        asyncio.run(probe(f"127.0.0.1:{port}", image_token))
    finally:
        os.killpg(child.pid, signal.SIGINT)
        child.wait(timeout=60)


if __name__ == "__main__":
    main()
