"""The three workloads of ``epd bench compare``, seeded: a text burst, an image burst, and mixed open-loop traffic.

Every request is greedy with a fixed output length (``ignore_eos``), so two
servers on the same checkpoint do the same work and their token counts can
be checked against each other. The requests are a function of the workload
and the seed alone: every server and every run gets the same bodies.
"""

from __future__ import annotations

import base64
import io
import json
import random
from dataclasses import dataclass
from typing import Any

from services.bench.serve.words import PROMPT_WORDS

IMAGE_SIZE = 224
"""Side of every image (PNG): one tile of the bench checkpoint's vision tower."""


@dataclass(frozen=True)
class Workload:
    """A named request pattern: burst (all at t=0) or open loop (Poisson arrivals per kind)."""

    name: str
    description: str
    max_tokens: int
    prompt_words: int
    burst_text: int = 0  # text requests sent at t=0
    burst_image: int = 0  # one-image requests sent at t=0
    text_rate: float = 0.0  # open loop: text requests per second
    image_rate: float = 0.0  # open loop: one-image requests per second
    seconds: float = 0.0  # open loop: length of the arrival schedule


WORKLOADS = {
    "burst": Workload("burst", "32 concurrent text requests, ~100-token prompts, 64 tokens out", 64, 40, burst_text=32),
    "image-burst": Workload(
        "image-burst", "16 concurrent requests, one 224x224 PNG each, 32 tokens out", 32, 12, burst_image=16
    ),
    # Device-sized bursts (a GPU PD serves 64 at once): text alone, and one request in four with an image.
    **{
        f"burst-{n}{suffix}": Workload(
            f"burst-{n}{suffix}",
            f"{n} concurrent requests, ~100-token prompts, 128 tokens out"
            + (f", {n // 4} of them with one 224x224 PNG" if images else ", text only"),
            128,
            40,
            burst_text=n - n // 4 if images else n,
            burst_image=n // 4 if images else 0,
        )
        for n in (16, 64)
        for images, suffix in ((False, ""), (True, "-images"))
    },
    "mixed": Workload(
        "mixed",
        "open loop for 60 s: text at 1 req/s beside one-image requests at 0.25 req/s, 64 tokens out",
        64,
        40,
        text_rate=1.0,
        image_rate=0.25,
        seconds=60.0,
    ),
}


@dataclass(frozen=True)
class Request:
    """One request of a workload: its kind ("text" | "image"), arrival (s after the run starts) and body."""

    index: int
    kind: str
    arrival_s: float
    body: dict[str, Any]


def build(workload: Workload, seed: int, *, scale: float = 1.0) -> list[Request]:
    """The requests of ``workload`` in arrival order (``scale`` shrinks counts and the schedule: smoke runs)."""
    rng = random.Random(f"epd-bench-compare:{workload.name}:{seed}")
    arrivals: list[tuple[float, str]] = []
    arrivals += [(0.0, "text")] * max(1, round(workload.burst_text * scale)) if workload.burst_text else []
    arrivals += [(0.0, "image")] * max(1, round(workload.burst_image * scale)) if workload.burst_image else []
    seconds = workload.seconds * scale
    for rate, kind in ((workload.text_rate, "text"), (workload.image_rate, "image")):
        if rate <= 0:
            continue
        t = rng.expovariate(rate)
        while t < seconds:
            arrivals.append((t, kind))
            t += rng.expovariate(rate)
    arrivals.sort(key=lambda a: a[0])
    requests = []
    for index, (arrival, kind) in enumerate(arrivals):
        prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(workload.prompt_words))
        image = _png(seed, workload.name, index) if kind == "image" else None
        requests.append(Request(index, kind, arrival, chat_body(prompt, image, workload.max_tokens)))
    return requests


def warmup(seed: int) -> list[Request]:
    """One short text and one image request (images no measured request sends): first-call costs stay out."""
    rng = random.Random(f"epd-bench-compare:warmup:{seed}")
    prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(16))
    return [
        Request(0, "text", 0.0, chat_body(prompt, None, 8)),
        Request(1, "image", 0.0, chat_body(prompt, _png(seed, "warmup", 1), 8)),
    ]


def _png(seed: int, name: str, index: int) -> str:
    """A data URL of a deterministic 224x224 noise PNG (no two share an embedding or a cache entry)."""
    import numpy as np
    from PIL import Image

    key = [seed, sum(name.encode()), len(name), index]
    pixels = np.random.default_rng(key).integers(0, 256, size=(IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_body(prompt: str, image_url: str | None, max_tokens: int) -> dict[str, Any]:
    """A streaming chat request: greedy, exactly ``max_tokens`` out, token ids and usage returned."""
    content: Any = prompt
    if image_url is not None:
        content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": prompt}]
    return {
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def encode(requests: list[Request], model: str) -> list[bytes]:
    """The JSON bodies, with the server's model id (built before the clock starts)."""
    return [json.dumps({"model": model, **r.body}, separators=(",", ":")).encode() for r in requests]
