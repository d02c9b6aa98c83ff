"""The OpenAI objects of one response: ``ResponseMeta`` and the chat and text-completion formatters.

A formatter turns one choice's text, token ids and logprobs into the
objects the client sees: streamed chunks (role, delta, finish, usage) and
the entries of a whole response.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.pb import epd_pb2


@dataclass
class ResponseMeta:
    """What every object of one response shares."""

    response_id: str
    model: str
    decode_token: Callable[[int], str]  # token id -> its text (for logprobs)
    num_images: int = 0
    num_video_tokens: int = 0  # prompt tokens that are video embeddings (usage.epd.video_tokens)
    return_token_ids: bool = False  # extension: each choice carries "token_ids"; the prompt's, as vLLM places them
    prompt_token_ids: list[int] = field(default_factory=list)  # the prompt's ids (with return_token_ids)
    hide_cache_details: bool = False  # --hide-cache-details: usage says nothing of what the caches did
    echo_text: str = ""  # completions' echo: the prompt's text, before each choice's own
    created: int = field(default_factory=lambda: int(time.time()))


class ChatFormatter:
    """``chat.completion`` / ``chat.completion.chunk`` objects."""

    object_name = "chat.completion.chunk"

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta

    def _chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, with_usage: bool = False
    ) -> dict[str, Any]:
        chunk = {
            "id": self.meta.response_id,
            "object": self.object_name,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        }
        if with_usage:
            chunk["usage"] = usage
        return chunk

    def role_chunk(self, index: int, with_usage: bool) -> dict[str, Any] | None:
        chunk = self._chunk(
            [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            with_usage=with_usage,
        )
        if self.meta.return_token_ids:  # vLLM: the prompt's ids in each choice's first chunk, at the top level
            chunk["prompt_token_ids"] = list(self.meta.prompt_token_ids)
        return chunk

    def delta_chunk(
        self,
        index: int,
        text: str,
        logprobs: list[epd_pb2.TokenLogprob] | None,
        with_usage: bool,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": {"content": text},
            "finish_reason": None,
            "logprobs": self.logprobs(logprobs) if logprobs is not None else None,
        }
        return self._chunk([self._with_ids(choice, token_ids)], with_usage=with_usage)

    def _with_ids(self, choice: dict[str, Any], token_ids: list[int] | None) -> dict[str, Any]:
        if self.meta.return_token_ids:
            choice["token_ids"] = list(token_ids or [])
        return choice

    def finish_chunk(self, index: int, reason: str, with_usage: bool) -> dict[str, Any]:
        return self._chunk(
            [{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}], with_usage=with_usage
        )

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._chunk([], usage=usage, with_usage=True)

    def choice(
        self, index: int, text: str, logprobs: list[epd_pb2.TokenLogprob] | None, reason: str, token_ids: list[int]
    ) -> dict[str, Any]:
        """One entry of a whole response's ``choices``."""
        choice = {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": self.logprobs(logprobs) if logprobs is not None else None,
            "finish_reason": reason,
        }
        return self._with_ids(choice, token_ids)

    def full(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        response = {
            "id": self.meta.response_id,
            "object": "chat.completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
            "usage": usage,
        }
        if self.meta.return_token_ids:  # vLLM: the prompt's ids at the top level of a chat response
            response["prompt_token_ids"] = list(self.meta.prompt_token_ids)
        return response

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.meta.decode_token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def logprobs(self, entries: list[epd_pb2.TokenLogprob]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **self._entry(e.token_id, e.logprob),
                    "top_logprobs": [self._entry(t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)],
                }
                for e in entries
            ]
        }


class CompletionFormatter(ChatFormatter):
    """``text_completion`` objects (streamed and whole)."""

    object_name = "text_completion"

    def __init__(self, meta: ResponseMeta) -> None:
        super().__init__(meta)
        # Characters of generated text per streamed choice so far: a chunk's
        # text_offset continues where the previous chunk's tokens ended.
        self._streamed_chars: dict[int, int] = {}
        self._echoed: set[int] = set()  # streamed choices whose prompt text went out already
        self._prompt_ids_sent: set[int] = set()  # streamed choices whose prompt_token_ids went out already

    def _with_echo(self, index: int, text: str) -> str:
        """``text``, after the prompt's text in the first chunk of choice ``index`` (``echo``)."""
        if not self.meta.echo_text or index in self._echoed:
            return text
        self._echoed.add(index)
        return self.meta.echo_text + text

    def role_chunk(self, index: int, with_usage: bool) -> dict[str, Any] | None:
        return None  # text completions have no role chunk

    def delta_chunk(
        self,
        index: int,
        text: str,
        logprobs: list[epd_pb2.TokenLogprob] | None,
        with_usage: bool,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": self._with_echo(index, text),
            "finish_reason": None,
            "logprobs": None if logprobs is None else self._streamed_logprobs(index, logprobs),
        }
        return self._chunk([self._with_prompt_ids(index, self._with_ids(choice, token_ids))], with_usage=with_usage)

    def _with_prompt_ids(self, index: int, choice: dict[str, Any]) -> dict[str, Any]:
        """vLLM: a completion choice carries the prompt's ids (streamed: in its first chunk only)."""
        if self.meta.return_token_ids and index not in self._prompt_ids_sent:
            self._prompt_ids_sent.add(index)
            choice["prompt_token_ids"] = list(self.meta.prompt_token_ids)
        return choice

    def _streamed_logprobs(self, index: int, entries: list[epd_pb2.TokenLogprob]) -> dict[str, Any]:
        result = self.logprobs(entries, start=self._streamed_chars.get(index, 0))
        offsets, tokens = result["text_offset"], result["tokens"]
        if offsets:
            self._streamed_chars[index] = offsets[-1] + len(tokens[-1])
        return result

    def finish_chunk(self, index: int, reason: str, with_usage: bool) -> dict[str, Any]:
        choice = {"index": index, "text": self._with_echo(index, ""), "logprobs": None, "finish_reason": reason}
        return self._chunk([self._with_prompt_ids(index, choice)], with_usage=with_usage)

    def choice(
        self, index: int, text: str, logprobs: list[epd_pb2.TokenLogprob] | None, reason: str, token_ids: list[int]
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": self.meta.echo_text + text,
            "finish_reason": reason,
            "logprobs": self.logprobs(logprobs) if logprobs is not None else None,
        }
        if self.meta.return_token_ids:
            choice["prompt_token_ids"] = list(self.meta.prompt_token_ids)
        return self._with_ids(choice, token_ids)

    def full(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.meta.response_id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
            "usage": usage,
        }

    def logprobs(self, entries: list[epd_pb2.TokenLogprob], start: int = 0) -> dict[str, Any]:
        """Legacy completions logprobs; ``text_offset`` counts characters of generated text from ``start``."""
        tokens = [self.meta.decode_token(e.token_id) for e in entries]
        offsets, position = [], start
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [self._top(token, e) for token, e in zip(tokens, entries)],
            "text_offset": offsets,
        }

    def _top(self, token: str, entry: epd_pb2.TokenLogprob) -> dict[str, float]:
        """A token's alternatives; with ``logprobs: 0`` (none asked) the sampled token alone, as OpenAI answers."""
        if not entry.top_token_ids:
            return {token: entry.logprob}
        return {self.meta.decode_token(t): lp for t, lp in zip(entry.top_token_ids, entry.top_logprobs)}
