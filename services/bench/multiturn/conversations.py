"""The seeded chats of ``epd bench multiturn``: one shared system prompt, an image per user, follow-ups.

A chat client resends the whole history every turn, the assistant's earlier
answers included: turn ``k`` of a user is the system prompt, the first user
message (text and the user's image), then ``k`` pairs of (answer, next
question). Text and images are functions of (seed, run, user, turn) alone, so
every policy of one run index meets the same chats; answers are the model's
own (greedy, a fixed length), so they are the same too.

The pacing (``pacing``) is seeded the same way: when each user starts and how
long it thinks before each follow-up are drawn per (seed, run, user), so
users' turns interleave as real chats' do, and every policy of one run index
meets the same schedule.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from typing import Any

from services.bench.serve.words import PROMPT_WORDS
from services.bench.serve.workload import ImageRef, render_image


@dataclass(frozen=True)
class ChatPlan:
    """The shape of every chat of a run."""

    num_users: int = 8
    num_turns: int = 4  # the first and 3 follow-ups
    system_words: int = 300  # the shared system prompt (~2.4 tokens a word with the bench tokenizer)
    question_words: int = 24  # each user message's text
    max_tokens: int = 32  # each answer (ignore_eos: every answer is this long)
    image_size: int = 224
    seed: int = 0


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(count))


def system_prompt(plan: ChatPlan) -> str:
    """The system prompt every chat of every run shares (a product's instructions)."""
    rng = random.Random(f"epd-bench-multiturn:system:{plan.seed}")
    return "You are a helpful assistant. " + _words(rng, plan.system_words)


def question(plan: ChatPlan, run: int, user: int, turn: int) -> str:
    """The text of ``user``'s message at ``turn`` of ``run``."""
    rng = random.Random(f"epd-bench-multiturn:question:{plan.seed}:{run}:{user}:{turn}")
    return _words(rng, plan.question_words) + "?"


def image_of(plan: ChatPlan, run: int, user: int) -> ImageRef:
    """The image of ``user``'s first message in ``run`` (distinct per user and run)."""
    return ImageRef((plan.seed, 3_000_000 + run, user), plan.image_size, plan.image_size)


PACINGS = ("exponential", "uniform", "fixed")
"""How think times and start gaps vary around their means: exponentially (a person's pauses: most short, some
long), uniformly within 50% of the mean, or not at all (every user in lock step)."""


@dataclass(frozen=True)
class Pace:
    """When one user sends its first turn (seconds after the run starts) and its pause before each follow-up."""

    start_s: float
    think_s: tuple[float, ...]  # one per follow-up (num_turns - 1)


def _draw(rng: random.Random, mean: float, kind: str) -> float:
    if mean <= 0 or kind == "fixed":
        return max(mean, 0.0)
    if kind == "uniform":
        return rng.uniform(0.5 * mean, 1.5 * mean)
    if kind == "exponential":
        return min(rng.expovariate(1.0 / mean), 5.0 * mean)  # capped: one pause does not stall a whole run
    raise ValueError(f"unknown pacing {kind!r}; expected one of {', '.join(PACINGS)}")


def pacing(plan: ChatPlan, run: int, stagger_s: float, think_s: float, kind: str = "exponential") -> list[Pace]:
    """Every user's pace in ``run``: gaps between consecutive users' starts average ``stagger_s``, think times
    average ``think_s``, both drawn as ``kind`` says. A function of (seed, run, the arguments) alone."""
    starts: list[float] = []
    at = 0.0
    for user in range(plan.num_users):
        if user:
            at += _draw(random.Random(f"epd-bench-multiturn:start:{plan.seed}:{run}:{user}"), stagger_s, kind)
        starts.append(at)
    paces = []
    for user, start in enumerate(starts):
        rng = random.Random(f"epd-bench-multiturn:think:{plan.seed}:{run}:{user}")
        paces.append(Pace(start, tuple(_draw(rng, think_s, kind) for _ in range(plan.num_turns - 1))))
    return paces


def image_url(ref: ImageRef) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(render_image(ref)).decode()


class Chat:
    """One user's history; ``body()`` is the next turn's request, ``answer(text)`` appends the reply."""

    def __init__(self, plan: ChatPlan, run: int, user: int, image: str) -> None:
        self.plan, self.run, self.user = plan, run, user
        first = [
            {"type": "text", "text": question(plan, run, user, 0)},
            {"type": "image_url", "image_url": {"url": image}},
        ]
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system_prompt(plan)},
            {"role": "user", "content": first},
        ]

    @property
    def turn(self) -> int:
        """The number of the next turn (0 = the first)."""
        return (len(self.messages) - 2) // 2

    def body(self) -> bytes:
        """The streaming chat request of the next turn (greedy, fixed length, token ids and usage returned)."""
        return json.dumps(
            {
                "messages": self.messages,
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": self.plan.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            separators=(",", ":"),
        ).encode()

    def answer(self, text: str) -> None:
        """The assistant's reply to the last turn, and the next question after it."""
        self.messages.append({"role": "assistant", "content": text})
        self.messages.append({"role": "user", "content": question(self.plan, self.run, self.user, self.turn + 1)})


def warmup_bodies(plan: ChatPlan, count: int) -> list[bytes]:
    """``count`` requests of the system prompt and a short question (some with an image): once every PD has
    served one, each holds the system prompt, as a PD that has been serving a while does."""
    bodies = []
    for index in range(count):
        chat = Chat(plan, 4_000_000, index, image_url(image_of(plan, 4_000_000, index)))
        if index % 2:
            chat.messages[1]["content"] = chat.messages[1]["content"][:1]  # text only
        bodies.append(chat.body())
    return bodies
