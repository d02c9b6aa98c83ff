"""The seeded chats of ``epd bench multiturn``: one shared system prompt, an image per user, follow-ups.

A chat client resends the whole history every turn, the assistant's earlier
answers included: turn ``k`` of a user is the system prompt, the first user
message (text and the user's image), then ``k`` pairs of (answer, next
question). Text and images are functions of (seed, run, user, turn) alone, so
every policy of one run index meets the same chats; answers are the model's
own (greedy, a fixed length), so they are the same too.
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
