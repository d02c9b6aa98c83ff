"""The requests the locustfile sends and the checks on what comes back.

Request bodies (a streaming chat with random prompt words and optional
images, or one of several broken inputs), random-noise JPEG data URLs, and
whether an error reply is a clean OpenAI error or an overload rejection a
client can act on. Plain functions, no Locust users: ``locustfile.py``
imports them (Locust puts the locustfile's folder on ``sys.path``).
"""

from __future__ import annotations

import base64
import io
import json
import random
from typing import Any

PROMPT_WORDS = (
    "tell",
    "me",
    "about",
    "the",
    "picture",
    "river",
    "city",
    "light",
    "story",
    "garden",
    "morning",
    "color",
    "window",
    "market",
    "quiet",
    "bright",
)

BAD_IMAGE_URLS = (
    "data:image/png;base64,not-base64!",
    "data:image/jpeg;base64," + base64.b64encode(b"these bytes are not an image").decode(),
    "data:text/plain;base64,aGVsbG8=",
    "file:///etc/passwd",
    "http://127.0.0.1:1/image.png",
)


def noise_image_url(data: bytes, size: int) -> str:
    """A JPEG data URL of ``size`` x ``size`` pixels made from ``data`` (3 bytes a pixel)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.frombytes("RGB", (size, size), data).save(buffer, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_body(rng: random.Random, image_urls: list[str], max_tokens: int) -> dict[str, Any]:
    """A streaming chat request of 24 random words and ``image_urls``, ``max_tokens`` tokens long (ignore_eos)."""
    prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(24))
    content: Any = prompt
    if image_urls:
        content = [{"type": "text", "text": prompt}] + [
            {"type": "image_url", "image_url": {"url": u}} for u in image_urls
        ]
    return {
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def bad_body(rng: random.Random) -> bytes:
    """One invalid chat request body: malformed JSON, a bad parameter, no messages, or a broken image."""
    choice = rng.randrange(5)
    if choice == 0:
        return b'{"messages": [{"role": "user", "content": "unterminated'
    if choice == 1:
        return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode()
    if choice == 2:
        return json.dumps({"messages": [], "max_tokens": 4}).encode()
    url = rng.choice(BAD_IMAGE_URLS)
    content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 4}).encode()


def clean_error(reply: Any) -> str | None:
    """Why an error reply is not a clean OpenAI error (JSON ``{"error": {...}}`` of at most 1 KiB), or None."""
    body = reply.content or b""
    if len(body) > 1024:
        return f"error body of {len(body)} bytes"
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return "error body is not JSON"
    if not isinstance(error, dict) or not error.get("message"):
        return "error body is not an OpenAI error"
    return None


def clean_rejection(reply: Any) -> bool:
    """An overload answer a client can act on: 429/503 with Retry-After and an OpenAI error body."""
    return reply.status_code in (429, 503) and bool(reply.headers.get("Retry-After")) and clean_error(reply) is None
