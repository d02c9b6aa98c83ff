"""Probe: do a few long image requests hold PD's embedding cache against every other image request?

Starts ``epd up`` on the tiny model with PD's embedding cache sized for four
images, sends four image requests with long outputs, and while they decode,
eight short requests with new images; prints the status and time of each.

    python load/embedding_cache_probe.py          # about a minute on two cores
"""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
from PIL import Image

from services.bench.serve.procs import epd_up
from services.common.models import ensure_model

IMAGE_TOKENS = 16  # the tiny model: 32x32 pixels in 8x8 patches
UP_ARGS = ["--proxy-metrics-port", "-1"]


def image_url(seed: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (seed * 37 % 256, seed * 91 % 256, seed * 13 % 256)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(model: str, seed: int, max_tokens: int) -> dict:
    content = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": image_url(seed)}}]
    return {
        "model": model,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": content}],
    }


def main() -> None:
    env = {"EPD_EMBEDDING_CACHE_TOKENS": str(4 * IMAGE_TOKENS)}
    with epd_up(str(ensure_model("tiny")), UP_ARGS, env) as base_url:
        url = base_url + "/v1/chat/completions"
        model = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
        long_statuses: list[int] = []
        threads = [
            threading.Thread(
                target=lambda s=s: long_statuses.append(
                    httpx.post(url, json=body(model, s, 1500), timeout=300).status_code
                )
            )
            for s in range(1, 5)
        ]
        for thread in threads:
            thread.start()
        time.sleep(3.0)  # the four decode
        others = []
        for seed in range(100, 108):
            started = time.monotonic()
            status = httpx.post(url, json=body(model, seed, 8), timeout=60).status_code
            others.append((status, round(time.monotonic() - started, 2)))
        for thread in threads:
            thread.join()
    print("four long requests:", long_statuses)
    print("eight other image requests while they decoded (status, seconds):", others)
    print("503s:", sum(status == 503 for status, _ in others), "of", len(others))


if __name__ == "__main__":
    main()
