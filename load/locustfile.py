"""Locust load test of an EPD cluster's OpenAI API: streaming chat over SSE.

Kinds of users, each sending ``/v1/chat/completions`` with ``stream: true``
and reading the server-sent events as they arrive:

- ``TextChatUser``: text only;
- ``ImageChatUser``: one new random-noise image per request (always encoded);
- ``RepeatedImageChatUser``: one image out of a small fixed pool (after the
  first round, served from the encoder's or PD's embedding cache);
- ``DisconnectingChatUser`` (weight 0 unless asked for): hangs up after a
  random number of tokens, half of the time with a new image;
- ``InvalidInputUser`` (weight 0 unless asked for): broken images, bad
  parameters and malformed JSON, each of which must get a clean 4xx.

Besides Locust's own ``POST`` entry (whose time is the time to the response
headers, since the body is streamed), every request reports custom metrics
through ``events.request``, so they get Locust's percentiles in the console,
the web UI and ``--csv`` files:

- ``TTFT <kind>``: request sent -> first generated token;
- ``ITL <kind>``: one entry per later token, the gap since the previous one
  (tokens that arrive in one SSE chunk share its time: the later get 0);
- ``E2E <kind>``: request sent -> ``data: [DONE]``.

A request fails (and Locust counts it) on a non-200 status, an error event
inside the stream, or a stream that ends without ``[DONE]``; a 429/503 with
``Retry-After`` and an OpenAI error body is a clean rejection, not a failure.
Every request also adds one ``OUTCOME`` entry named ``succeeded``,
``rejected``, ``disconnected``, ``bad-input-rejected`` or ``failed``.

Headless, bounded run against a cluster started with ``epd up``::

    locust -f load/locustfile.py --headless -u 4 -r 2 -t 30s --host http://127.0.0.1:8000

Options (command line or environment): ``--text-weight`` / ``EPD_LOAD_TEXT_WEIGHT``
(default 3), ``--image-weight`` / ``EPD_LOAD_IMAGE_WEIGHT`` (1),
``--repeat-weight`` / ``EPD_LOAD_REPEAT_WEIGHT`` (1), ``--max-tokens`` /
``EPD_LOAD_MAX_TOKENS`` (32), ``--image-size`` / ``EPD_LOAD_IMAGE_SIZE`` (224),
``--image-pool`` / ``EPD_LOAD_IMAGE_POOL`` (4), ``--think-time`` /
``EPD_LOAD_THINK_TIME`` (seconds between a user's requests, default 0.5),
``--disconnect-weight`` / ``EPD_LOAD_DISCONNECT_WEIGHT`` (0) and
``--invalid-weight`` / ``EPD_LOAD_INVALID_WEIGHT`` (0).
A weight of 0 leaves that kind of user out.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from chat_requests import bad_body, chat_body, clean_error, clean_rejection, noise_image_url
from locust import HttpUser, events, task

CHAT_PATH = "/v1/chat/completions"


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    group = parser.add_argument_group("EPD chat load")
    group.add_argument(
        "--text-weight", type=int, default=3, env_var="EPD_LOAD_TEXT_WEIGHT", help="weight of TextChatUser (0 = none)"
    )
    group.add_argument(
        "--image-weight",
        type=int,
        default=1,
        env_var="EPD_LOAD_IMAGE_WEIGHT",
        help="weight of ImageChatUser (0 = none)",
    )
    group.add_argument(
        "--repeat-weight",
        type=int,
        default=1,
        env_var="EPD_LOAD_REPEAT_WEIGHT",
        help="weight of RepeatedImageChatUser (0 = none)",
    )
    group.add_argument(
        "--disconnect-weight",
        type=int,
        default=0,
        env_var="EPD_LOAD_DISCONNECT_WEIGHT",
        help="weight of DisconnectingChatUser (0 = none)",
    )
    group.add_argument(
        "--invalid-weight",
        type=int,
        default=0,
        env_var="EPD_LOAD_INVALID_WEIGHT",
        help="weight of InvalidInputUser (0 = none)",
    )
    group.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        env_var="EPD_LOAD_MAX_TOKENS",
        help="output tokens of every request (ignore_eos)",
    )
    group.add_argument(
        "--image-size",
        type=int,
        default=224,
        env_var="EPD_LOAD_IMAGE_SIZE",
        help="side of the square noise images, pixels",
    )
    group.add_argument(
        "--image-pool",
        type=int,
        default=4,
        env_var="EPD_LOAD_IMAGE_POOL",
        help="distinct images RepeatedImageChatUser cycles through",
    )
    group.add_argument(
        "--think-time",
        type=float,
        default=0.5,
        env_var="EPD_LOAD_THINK_TIME",
        help="seconds each user waits between its requests",
    )


@events.init.add_listener
def _apply_options(environment: Any, **_: Any) -> None:
    """Weights come from the options: set them before the runner dispatches users."""
    options = environment.parsed_options
    if options is None:  # used as a library without a command line
        return
    TextChatUser.weight = options.text_weight
    ImageChatUser.weight = options.image_weight
    RepeatedImageChatUser.weight = options.repeat_weight
    DisconnectingChatUser.weight = options.disconnect_weight
    InvalidInputUser.weight = options.invalid_weight
    weights = (
        options.text_weight,
        options.image_weight,
        options.repeat_weight,
        options.disconnect_weight,
        options.invalid_weight,
    )
    if min(weights) < 0 or sum(weights) <= 0:
        raise ValueError("user weights must be >= 0 and at least one positive")


def _fire(environment: Any, kind: str, name: str, milliseconds: float) -> None:
    environment.events.request.fire(
        request_type=kind, name=name, response_time=milliseconds, response_length=0, exception=None, context={}
    )


def _outcome(environment: Any, outcome: str) -> None:
    """One ``OUTCOME`` entry per request: succeeded, rejected, disconnected, bad-input-rejected or failed."""
    _fire(environment, "OUTCOME", outcome, 0.0)


class _ChatUser(HttpUser):
    """One streaming chat request per task; subclasses choose the images."""

    abstract = True
    kind = "chat"

    def wait_time(self) -> float:
        return self.environment.parsed_options.think_time if self.environment.parsed_options else 0.5

    read_limit: int | None = None  # hang up after this many token events (DisconnectingChatUser)
    hung_up = False

    def on_start(self) -> None:
        self.rng = random.Random()

    def image_urls(self) -> list[str]:
        return []

    def _body(self) -> dict[str, Any]:
        options = self.environment.parsed_options
        return chat_body(self.rng, self.image_urls(), options.max_tokens if options else 32)

    @task
    def chat(self) -> None:
        body = self._body()
        sent = time.perf_counter()
        with self.client.post(
            CHAT_PATH, json=body, stream=True, catch_response=True, name=f"chat {self.kind}"
        ) as reply:
            if reply.status_code != 200:
                if clean_rejection(reply):  # overload, answered the way clients are told to retry
                    reply.success()
                    _outcome(self.environment, "rejected")
                else:
                    reply.failure(f"HTTP {reply.status_code}")
                    _outcome(self.environment, "failed")
                return
            problem = self._read_stream(reply, sent)
            if problem:
                reply.failure(problem)
                _outcome(self.environment, "failed")
            elif self.read_limit is not None and self.hung_up:
                reply.close()  # drop the connection with the stream half read
                reply.success()
                _outcome(self.environment, "disconnected")
            else:
                reply.success()
                _outcome(self.environment, "succeeded")
                _fire(self.environment, "E2E", self.kind, (time.perf_counter() - sent) * 1000)

    def _read_stream(self, reply: Any, sent: float) -> str | None:
        """Fires TTFT and ITL as tokens arrive; returns why the stream failed, or None."""
        last: float | None = None
        self._events, self.hung_up = 0, False
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
            if self.read_limit is not None and self._events >= self.read_limit:
                self.hung_up = True
                return None
            self._events += 1
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


class DisconnectingChatUser(_ChatUser):
    """Streams a chat (half of them with a new image) and hangs up after a random number of tokens.

    The cluster must cancel the request everywhere: nothing may stay reserved,
    queued or pushed for it.
    """

    kind = "disconnect"
    weight = 1  # non-zero so Locust keeps the class; --disconnect-weight (default 0) sets the real weight

    def image_urls(self) -> list[str]:
        if self.rng.random() < 0.5:
            return []
        size = self.environment.parsed_options.image_size if self.environment.parsed_options else 224
        return [noise_image_url(os.urandom(size * size * 3), size)]

    def _body(self) -> dict[str, Any]:
        body = super()._body()
        self.read_limit = self.rng.randrange(body["max_tokens"])  # 0 = before the first token
        return body


class InvalidInputUser(HttpUser):
    """Invalid requests: broken images, bad parameters, malformed JSON. Each must get a clean 4xx."""

    weight = 1  # as DisconnectingChatUser: --invalid-weight (default 0) sets the real weight

    def wait_time(self) -> float:
        return self.environment.parsed_options.think_time if self.environment.parsed_options else 0.5

    def on_start(self) -> None:
        self.rng = random.Random()

    @task
    def bad_request(self) -> None:
        headers = {"Content-Type": "application/json"}
        with self.client.post(
            CHAT_PATH, data=bad_body(self.rng), headers=headers, catch_response=True, name="chat invalid"
        ) as reply:
            problem = None if 400 <= reply.status_code < 500 else f"HTTP {reply.status_code} for a bad input"
            problem = problem or clean_error(reply)
            if problem:
                reply.failure(problem)
                _outcome(self.environment, "failed")
            else:
                reply.success()
                _outcome(self.environment, "bad-input-rejected")
