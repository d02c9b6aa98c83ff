"""The PD engine of ``epd bench engine``, driven offline through its asyncio API.

``Workload`` (the prompts every system runs) and ``Result`` (what a system
measured) are shared with the ``transformers`` baselines (``hf.py``) and the
report (``command.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Workload:
    """The prompts every system runs, and how many tokens each generates."""

    prompts: list[list[int]]
    output_len: int


@dataclass
class Result:
    system: str
    seconds: list[float] = field(default_factory=list)
    num_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # engine: steps and where their time went

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.median_s


def bench_schema(output_len: int) -> dict[str, Any]:
    """The JSON schema of ``engine_structured``'s constrained requests.

    Structure first (a bounded integer, an enum, an array of booleans), where
    each token's mask depends on the grammar state, then a string of at least
    ``8 * output_len`` characters: no token of the bench tokenizers is that
    long on average, so no constrained request completes its JSON (and stops)
    before ``output_len`` tokens.
    """
    return {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "kind": {"enum": ["photo", "chart", "scan", "other"]},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            "text": {"type": "string", "minLength": 8 * output_len},
        },
        "required": ["id", "kind", "flags", "text"],
        "additionalProperties": False,
    }


class EngineRunner:
    """This repository's PD engine, driven offline through its asyncio API.

    ``structured_share``: that share of the requests (spread evenly) is
    constrained by ``bench_schema``; its grammar is compiled here, before any
    measurement, as a server's cache would hold it.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        model_dir: str,
        workload: Workload,
        linear_backend: str = "auto",
        *,
        structured_share: float = 0.0,
    ):
        from services.pd.config import PdConfig
        from services.pd.server import build_engine

        longest = max(args.max_prompt, args.ttft_prompt) + args.output_len
        per_request = -(-longest // args.block_size)
        config = PdConfig(
            model=model_dir,
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.num_requests,
            # Room for every request at full length (as the static batch has) plus the TTFT prompts.
            num_kv_blocks=(args.num_requests + 2) * per_request,
            linear_backend=linear_backend,
            slo_itl_ms=0,  # throughput: every step may use the whole budget, as generate_batch's does
        )
        self.engine, self.facts = build_engine(config)
        self.workload = workload
        num_constrained = round(structured_share * len(workload.prompts))
        self.constrained = {i * len(workload.prompts) // num_constrained for i in range(num_constrained)}
        self.spec = None
        if self.constrained:
            from services.pd.engine.request import StructuredOutputSpec

            self.spec = StructuredOutputSpec("json_schema", json.dumps(bench_schema(workload.output_len)))
            self.facts["grammars"].matcher(self.spec)  # compiled and cached before the clock starts
        self.loop = asyncio.new_event_loop()
        self.engine.start()
        from services.pd.server import warm_up

        self.loop.run_until_complete(warm_up(self.engine))

    def close(self) -> None:
        self.engine.shutdown()
        if self.facts["grammars"] is not None:  # its compile thread and process
            self.facts["grammars"].shutdown()
        self.loop.close()

    def measure(self) -> tuple[float, list[list[int]], dict[str, Any]]:
        """Runs the workload once: (seconds, outputs, step details)."""
        # Prompts repeat across rounds: forget cached prefixes so every round computes everything.
        self.loop.run_until_complete(self.engine.call(self.engine.core.kv_cache.reset_prefix_cache))
        before = self.loop.run_until_complete(self.engine.stats())
        seconds, outputs = self.loop.run_until_complete(self._generate_all())
        after = self.loop.run_until_complete(self.engine.stats())
        return (
            seconds,
            outputs,
            {key: getattr(after, key) - getattr(before, key) for key in ("num_steps", "num_preemptions")}
            | {
                f"{phase}_ms": int((after.steps.seconds[phase] - spent) * 1000)
                for phase, spent in before.steps.seconds.items()
            },
        )

    async def _generate_all(self) -> tuple[float, list[list[int]]]:
        from services.pd.engine.request import Request, SamplingParams

        sampling = SamplingParams(temperature=0.0, max_tokens=self.workload.output_len, ignore_eos=True)
        constrained = dataclasses.replace(sampling, structured_output=self.spec)
        tag = time.monotonic_ns()
        started = time.perf_counter()
        requests = []
        for i, prompt in enumerate(self.workload.prompts):
            request = Request(f"bench-{tag}-{i}", list(prompt), constrained if i in self.constrained else sampling)
            if i in self.constrained:
                request.grammar = self.facts["grammars"].matcher(self.spec)  # compiled already: a cache hit
            requests.append(request)
        # All at once: every add_request lands in the engine's inbox in this loop tick.
        queues = await asyncio.gather(*(self.engine.add_request(request) for request in requests))
        outputs = await asyncio.gather(*(self._collect(q) for q in queues))
        return time.perf_counter() - started, [tokens for tokens, _, _ in outputs]

    @staticmethod
    async def _collect(events: asyncio.Queue) -> tuple[list[int], float, Any]:
        """Tokens of one request, when its first token arrived, and the finished request."""
        from services.pd.engine.outputs import Failed, Finished, TokenDelta

        tokens: list[int] = []
        first = 0.0
        while True:
            event = await events.get()
            if isinstance(event, TokenDelta):
                first = first or time.perf_counter()
                tokens += event.token_ids
            elif isinstance(event, Finished):
                return tokens, first, event.request
            elif isinstance(event, Failed):
                raise RuntimeError(f"engine request failed: {event.error.message}")

    def prefix_cache_ttft(
        self,
        args: argparse.Namespace,
        image_token_id: int,
        num_image_tokens: int,
        hidden_size: int,
        vocab: list[int],
        round_index: int,
    ) -> dict[str, Any]:
        return self.loop.run_until_complete(
            self._ttft_pair(args, image_token_id, num_image_tokens, hidden_size, vocab, round_index)
        )

    async def _ttft_pair(self, args, image_token_id, num_image_tokens, hidden_size, vocab, round_index):
        import torch

        from services.pd.engine.request import MultiModalSpan, Request, SamplingParams

        rng = random.Random(args.seed * 1000 + round_index)
        prefix = [rng.choice(vocab) for _ in range(32)]
        suffix = [rng.choice(vocab) for _ in range(max(1, args.ttft_prompt - 32 - num_image_tokens))]
        prompt = prefix + [image_token_id] * num_image_tokens + suffix
        mm_hash = hashlib.sha256(f"bench-image-{args.seed}-{round_index}".encode()).hexdigest()
        span = MultiModalSpan(mm_hash, len(prefix), num_image_tokens)
        embedding = torch.randn(num_image_tokens, hidden_size, generator=torch.Generator().manual_seed(round_index))
        sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        runs = []
        for attempt in ("first", "repeat"):
            request_id = f"ttft-{round_index}-{attempt}-{time.monotonic_ns()}"
            [allocation] = await self.engine.preallocate(request_id, [span], 60.0, prompt_token_ids=prompt)
            if not allocation.ready:
                await self.engine.push(request_id, allocation.reservation_id, mm_hash, embedding)
            started = time.perf_counter()
            events = await self.engine.add_request(Request(request_id, list(prompt), sampling, mm_spans=[span]))
            _, first_token, request = await self._collect(events)
            runs.append(
                {
                    "ttft_ms": (first_token - started) * 1000,
                    "cached_tokens": request.num_cached_tokens,
                    "preallocate": "READY" if allocation.ready else "RESERVED",
                    "via_prefix_cache": allocation.via_prefix_cache,
                }
            )
        return {"prompt_tokens": len(prompt), "image_tokens": num_image_tokens, "first": runs[0], "repeat": runs[1]}
