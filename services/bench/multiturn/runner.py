"""One measured run of ``epd bench multiturn``: a cluster, the users' chats, what the proxy counted.

A run starts the cluster (one encoder, ``num_pds`` PDs, one proxy with the
policy under test) as ``epd bench serve`` does (``serve.procs``), warms every
PD up with the system prompt, then runs the users at once: each starts
on average ``stagger_s`` after the previous one and sends its turns one after
another (the next when the answer is complete, after a think time averaging
``think_s``), as a person in a chat does; starts and think times are drawn
per user from the seed (``conversations.pacing``), so turns of different
users interleave and every policy meets the same schedule. Every turn is
timed by ``serve.client``; its usage says how many prompt tokens PD served
from its prefix cache and whether the image was already on PD. The proxy's
``/metrics``, read before and after, give the requests each PD served and
the Encode calls.
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.bench.multiturn.conversations import Chat, ChatPlan, Pace, image_of, image_url, pacing, warmup_bodies
from services.bench.serve.client import Targets, run_schedule, send_one
from services.bench.serve.layout import ProcessSpec, Topology
from services.bench.serve.procs import Cluster, ServiceArgs
from services.bench.serve.stats import RequestRecord
from services.bench.serve.workload import RequestSpec

SHARED_MACHINE_PD_ARGS = ("--stall-timeout-s", "0")
"""On a shared machine a step can stall for a minute: PD must not report itself not ready for it."""
SHARED_MACHINE_PROXY_ARGS = ("--inter-token-timeout-s", "0", "--request-timeout", "3600")
"""... nor the proxy end the generation (the client's own timeout still bounds a turn)."""


@dataclass(frozen=True)
class RunSettings:
    """How users pace their chats, and the cluster's bounds."""

    stagger_s: float = 1.0  # mean gap between two users' first turns
    think_s: float = 2.0  # mean pause between an answer and the user's next turn
    pacing: str = "exponential"  # how gaps and pauses vary around their means (conversations.PACINGS)
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 900.0


@dataclass
class Turn:
    """What the client saw of one turn."""

    user: int
    turn: int
    record: RequestRecord
    cached_tokens: int = 0
    images_ready: int = 0  # images PD already held (no Encode)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens PD had to compute (the rest came from its prefix cache)."""
        return self.record.prompt_tokens - self.cached_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "user": self.user,
            "turn": self.turn,
            "cached_tokens": self.cached_tokens,
            "images_ready": self.images_ready,
            **self.record.to_json(),
        }


@dataclass
class RunResult:
    """One policy's run on one cluster."""

    policy: str
    num_pds: int
    run: int
    turns: list[Turn] = field(default_factory=list)
    pd_requests: dict[str, float] = field(default_factory=dict)  # PD address -> attempts that ended OK
    encode_calls: float = 0.0
    error: str | None = None


def topology(num_pds: int, cores: Sequence[int]) -> Topology:
    """One encoder over every core, ``num_pds`` PDs spread over the cores (one thread each), one proxy."""
    pd_names = tuple(f"pd-{i}" for i in range(num_pds))
    processes = [
        ProcessSpec("encoder-0", "encoder", tuple(cores), 1, push_to=pd_names),
        *(ProcessSpec(name, "pd", (cores[i % len(cores)],), 1) for i, name in enumerate(pd_names)),
        ProcessSpec("proxy-0", "proxy", (cores[0],), 1, pd_names=pd_names, encoder_names=("encoder-0",)),
    ]
    notes = (f"{num_pds} PDs on {len(cores)} cores: PD i on core i mod {len(cores)}; the encoder over all of them",)
    return Topology(f"pds{num_pds}", f"{num_pds} PDs", tuple(processes), notes)


def proxy_counters(url: str) -> dict[tuple[str, ...], float]:
    """The proxy's ``epd_proxy_backend_requests_total`` samples, keyed by (kind, address, status)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    counters: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "epd_proxy_backend_requests_total":
                labels = sample.labels
                counters[(labels["kind"], labels["address"], labels["status"])] = sample.value
    return counters


class _Reply:
    """The answer's text and the usage, from a turn's stream chunks."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.usage: dict[str, Any] = {}

    def on_chunk(self, payload: dict) -> None:
        for choice in payload.get("choices") or ():
            self.text.append((choice.get("delta") or {}).get("content") or "")
        self.usage.update(payload.get("usage") or {})


async def _chat(client: httpx.AsyncClient, targets: Targets, chat: Chat, pace: Pace, run_start: float) -> list[Turn]:
    """One user's turns, one after another, paced by ``pace``."""
    await asyncio.sleep(pace.start_s)
    turns = []
    for number in range(chat.plan.num_turns):
        reply = _Reply()
        record = RequestRecord(
            index=chat.user * 100 + number, kind="image", num_images=1, image_class=None, scheduled_s=0.0
        )
        await send_one(client, targets, chat.body(), record, run_start, reply.on_chunk)
        usage = reply.usage
        turns.append(
            Turn(
                chat.user,
                number,
                record,
                cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                images_ready=int((usage.get("epd") or {}).get("num_images_ready") or 0),
            )
        )
        if not record.ok:
            break  # the history is broken: the chat ends here
        chat.answer("".join(reply.text))
        if number < len(pace.think_s):
            await asyncio.sleep(pace.think_s[number])
    return turns


async def run_chats(url: str, plan: ChatPlan, run: int, settings: RunSettings) -> list[Turn]:
    """Every user's chat at once (staggered starts); their turns in user, turn order."""
    chats = [Chat(plan, run, user, image_url(image_of(plan, run, user))) for user in range(plan.num_users)]
    paces = pacing(plan, run, settings.stagger_s, settings.think_s, settings.pacing)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=plan.num_users)
    timeout = httpx.Timeout(settings.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        targets, run_start = Targets([url]), time.perf_counter()
        done = await asyncio.gather(
            *(_chat(client, targets, chat, pace, run_start) for chat, pace in zip(chats, paces, strict=True))
        )
    return [turn for turns in done for turn in turns]


def warm_up(url: str, plan: ChatPlan, num_pds: int, settings: RunSettings) -> None:
    """Two requests per PD at once (untimed): first-call costs stay out, and every PD holds the system prompt."""
    bodies = warmup_bodies(plan, 2 * num_pds)
    specs = [RequestSpec(i, "", (), None, plan.max_tokens) for i in range(len(bodies))]
    records = asyncio.run(
        run_schedule([url], specs, bodies, [0.0] * len(bodies), request_timeout_s=settings.request_timeout_s)
    )
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[:3]}")


def run_one(
    policy: str,
    num_pds: int,
    run: int,
    *,
    plan: ChatPlan,
    service: ServiceArgs,
    cores: Sequence[int],
    settings: RunSettings,
    log_dir: Path,
) -> RunResult:
    """Starts the cluster with ``policy``, runs the chats of ``run``, stops it."""
    result = RunResult(policy, num_pds, run)
    topo = topology(num_pds, cores)
    args = ServiceArgs(
        **{
            **service.__dict__,
            "pd_args": (*SHARED_MACHINE_PD_ARGS, *service.pd_args),
            "proxy_args": (*SHARED_MACHINE_PROXY_ARGS, *service.proxy_args, "--pd-policy", policy),
        }
    )
    cluster = Cluster(topo, args, log_dir / f"{policy}-run{run}")
    _say(f"[{policy}, {num_pds} PDs, run {run + 1}] starting")
    try:
        cluster.start()
        asyncio.run(cluster.wait_ready(settings.startup_timeout_s))
        url = cluster.proxy_urls[0]
        warm_up(url, plan, num_pds, settings)
        before = proxy_counters(url)
        started = time.monotonic()
        result.turns = asyncio.run(run_chats(url, plan, run, settings))
        after = proxy_counters(url)
        for (kind, address, status), value in after.items():
            delta = value - before.get((kind, address, status), 0.0)
            if kind == "pd" and status == "OK":
                result.pd_requests[address] = delta
            elif kind == "encoder":
                result.encode_calls += delta
        for spec in topo.processes:  # PDs that served nothing show as 0
            if spec.role == "pd":
                result.pd_requests.setdefault(cluster.child(spec.name).address, 0.0)
        failed = sum(not t.record.ok for t in result.turns)
        _say(
            f"[{policy}, {num_pds} PDs, run {run + 1}] {len(result.turns)} turns ({failed} failed) "
            f"in {time.monotonic() - started:.1f}s"
        )
        dead = cluster.exited()
        if dead:
            raise RuntimeError(f"process(es) exited during the run: {', '.join(dead)}")
    except (RuntimeError, TimeoutError, OSError) as error:
        result.error = str(error)
        _say(f"[{policy}, {num_pds} PDs, run {run + 1}] FAILED: {error}")
    finally:
        cluster.stop()
    return result


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
