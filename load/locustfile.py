"""Locust load test of an EPD cluster's OpenAI API: streaming chat over SSE.

Three kinds of users, each sending ``/v1/chat/completions`` with
``stream: true`` and reading the server-sent events as they arrive:

- ``TextChatUser``: text only;
- ``ImageChatUser``: one new random-noise image per request (always encoded);
- ``RepeatedImageChatUser``: one image out of a small fixed pool (after the
  first round, served from the encoder's or PD's embedding cache).

Besides Locust's own ``POST`` entry (whose time is the time to the response
headers, since the body is streamed), every request reports custom metrics
through ``events.request``, so they get Locust's percentiles in the console,
the web UI and ``--csv`` files:

- ``TTFT <kind>``: request sent -> first generated token;
- ``ITL <kind>``: one entry per later token, the gap since the previous one
  (tokens that arrive in one SSE chunk share its time: the later get 0);
- ``E2E <kind>``: request sent -> ``data: [DONE]``.

A request fails (and Locust counts it) on a non-200 status, an error event
inside the stream, or a stream that ends without ``[DONE]``.

Headless, bounded run against a cluster started with ``epd up``::

    locust -f load/locustfile.py --headless -u 4 -r 2 -t 30s --host http://127.0.0.1:8000

Options (command line or environment): ``--text-weight`` / ``EPD_LOAD_TEXT_WEIGHT``
(default 3), ``--image-weight`` / ``EPD_LOAD_IMAGE_WEIGHT`` (1),
``--repeat-weight`` / ``EPD_LOAD_REPEAT_WEIGHT`` (1), ``--max-tokens`` /
``EPD_LOAD_MAX_TOKENS`` (32), ``--image-size`` / ``EPD_LOAD_IMAGE_SIZE`` (224),
``--image-pool`` / ``EPD_LOAD_IMAGE_POOL`` (4), ``--think-time`` /
``EPD_LOAD_THINK_TIME`` (seconds between a user's requests, default 0.5).
A weight of 0 leaves that kind of user out.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import time
from typing import Any

from locust import HttpUser, events, task

CHAT_PATH = "/v1/chat/completions"
PROMPT_WORDS = ("tell", "me", "about", "the", "picture", "river", "city", "light", "story", "garden", "morning",
                "color", "window", "market", "quiet", "bright")


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    group = parser.add_argument_group("EPD chat load")
    group.add_argument("--text-weight", type=int, default=3, env_var="EPD_LOAD_TEXT_WEIGHT",
                       help="weight of TextChatUser (0 = none)")
    group.add_argument("--image-weight", type=int, default=1, env_var="EPD_LOAD_IMAGE_WEIGHT",
                       help="weight of ImageChatUser (0 = none)")
    group.add_argument("--repeat-weight", type=int, default=1, env_var="EPD_LOAD_REPEAT_WEIGHT",
                       help="weight of RepeatedImageChatUser (0 = none)")
    group.add_argument("--max-tokens", type=int, default=32, env_var="EPD_LOAD_MAX_TOKENS",
                       help="output tokens of every request (ignore_eos)")
    group.add_argument("--image-size", type=int, default=224, env_var="EPD_LOAD_IMAGE_SIZE",
                       help="side of the square noise images, pixels")
    group.add_argument("--image-pool", type=int, default=4, env_var="EPD_LOAD_IMAGE_POOL",
                       help="distinct images RepeatedImageChatUser cycles through")
    group.add_argument("--think-time", type=float, default=0.5, env_var="EPD_LOAD_THINK_TIME",
                       help="seconds each user waits between its requests")


@events.init.add_listener
def _apply_options(environment: Any, **_: Any) -> None:
    """Weights come from the options: set them before the runner dispatches users."""
    options = environment.parsed_options
    if options is None:  # used as a library without a command line
        return
    TextChatUser.weight = options.text_weight
    ImageChatUser.weight = options.image_weight
    RepeatedImageChatUser.weight = options.repeat_weight
    if options.text_weight + options.image_weight + options.repeat_weight <= 0:
        raise ValueError("at least one of --text-weight, --image-weight, --repeat-weight must be positive")


def noise_image_url(data: bytes, size: int) -> str:
    """A JPEG data URL of ``size`` x ``size`` pixels made from ``data`` (3 bytes a pixel)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.frombytes("RGB", (size, size), data).save(buffer, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def _fire(environment: Any, kind: str, name: str, milliseconds: float) -> None:
    environment.events.request.fire(request_type=kind, name=name, response_time=milliseconds, response_length=0,
                                    exception=None, context={})


class _ChatUser(HttpUser):
    """One streaming chat request per task; subclasses choose the images."""

    abstract = True
    kind = "chat"

    def wait_time(self) -> float:
        return self.environment.parsed_options.think_time if self.environment.parsed_options else 0.5

    def on_start(self) -> None:
        self.rng = random.Random()

    def image_urls(self) -> list[str]:
        return []

    def _body(self) -> dict[str, Any]:
        options = self.environment.parsed_options
        prompt = " ".join(self.rng.choice(PROMPT_WORDS) for _ in range(24))
        urls = self.image_urls()
        content: Any = prompt
        if urls:
            content = [{"type": "text", "text": prompt}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        return {
            "messages": [{"role": "user", "content": content}],
            "stream": True,
            "max_tokens": options.max_tokens if options else 32,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }

    @task
    def chat(self) -> None:
        body = self._body()
        sent = time.perf_counter()
        with self.client.post(CHAT_PATH, json=body, stream=True, catch_response=True, name=f"chat {self.kind}") as reply:
            if reply.status_code != 200:
                reply.failure(f"HTTP {reply.status_code}")
                return
            problem = self._read_stream(reply, sent)
            if problem:
                reply.failure(problem)
            else:
                reply.success()
                _fire(self.environment, "E2E", self.kind, (time.perf_counter() - sent) * 1000)

    def _read_stream(self, reply: Any, sent: float) -> str | None:
        """Fires TTFT and ITL as tokens arrive; returns why the stream failed, or None."""
        last: float | None = None
        for line in reply.iter_lines():
            if not line or not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                return None if last is not None else "no tokens"
            payload = json.loads(data)
            if "error" in payload:
                error = payload["error"] or {}
                return f"stream error: {error.get('code') or error.get('type') or 'error'}"
            count = sum(len(choice.get("token_ids") or ()) for choice in payload.get("choices") or ())
            if not count:
                continue
            now = time.perf_counter()
            if last is None:
                _fire(self.environment, "TTFT", self.kind, (now - sent) * 1000)
            else:
                _fire(self.environment, "ITL", self.kind, (now - last) * 1000)
            for _ in range(count - 1):
                _fire(self.environment, "ITL", self.kind, 0.0)  # arrived in the same chunk
            last = now
        return "stream ended without [DONE]"


class TextChatUser(_ChatUser):
    """Text-only chat."""

    kind = "text"
    weight = 3


class ImageChatUser(_ChatUser):
    """Chat with one new random image each time (never cached)."""

    kind = "image"
    weight = 1

    def image_urls(self) -> list[str]:
        size = self.environment.parsed_options.image_size if self.environment.parsed_options else 224
        return [noise_image_url(os.urandom(size * size * 3), size)]


class RepeatedImageChatUser(_ChatUser):
    """Chat with one image out of a small fixed pool, the same for every user (cache reuse)."""

    kind = "repeated-image"
    weight = 1

    def on_start(self) -> None:
        super().on_start()
        options = self.environment.parsed_options
        size = options.image_size if options else 224
        pool = options.image_pool if options else 4
        seeded = random.Random(1234)  # every user and every run: the same images
        self.pool = [noise_image_url(seeded.randbytes(size * size * 3), size) for _ in range(max(1, pool))]

    def image_urls(self) -> list[str]:
        return [self.rng.choice(self.pool)]
