"""One backend instance as the proxy sees it: channel, readiness, load, circuit breaker.

Routing reads three kinds of state, each owned by one writer:

- ``readiness``: written by the health monitor (grpc.health.v1 Watch);
- ``load`` / ``load_baseline``: written by the load poller (GetLoad);
- ``num_outstanding`` and the breaker: written by the pipeline around each call
  (``begin()`` / ``end(outcome)``, always paired).

All of it lives on the proxy's event loop; nothing here blocks or locks.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import grpc_utils
from services.common.pb import epd_pb2, epd_pb2_grpc

log = logging.getLogger(__name__)

PD_SERVICE = "epd.v1.PrefillDecode"
ENCODER_SERVICE = "epd.v1.Encoder"
ABORT_TIMEOUT_S = 5.0
"""Abort is cleanup: it gets its own short timeout, not the (maybe spent) request deadline."""

RETURNING_HALF_LIFE_S = 30.0
"""How fast ``PdClient.returning_tokens`` forgets a finished call: a user's next turn comes within seconds
to minutes of the answer."""

Clock = Callable[[], float]


class Readiness(enum.IntEnum):
    """What the instance's health service last said (UNKNOWN until the first answer)."""

    UNKNOWN = 0
    READY = 1
    NOT_READY = 2


class Outcome(enum.IntEnum):
    """How a call ended, as far as the instance's health is concerned."""

    SUCCESS = 0
    NEUTRAL = 1  # the caller's fault or choice (bad input, deadline, overload, cancellation)
    FAILURE = 2  # the instance is broken or unreachable


_FAILURE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def outcome_of(code: grpc.StatusCode) -> Outcome:
    """The breaker's reading of a status code; deadlines and overload are not the instance's fault."""
    if code == grpc.StatusCode.OK:
        return Outcome.SUCCESS
    return Outcome.FAILURE if code in _FAILURE_CODES else Outcome.NEUTRAL


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Consecutive-failure circuit breaker of one instance.

    CLOSED until ``threshold`` failures in a row; then OPEN (no traffic) for
    ``open_s``; then HALF_OPEN: one probe call at a time. A successful probe
    closes it; a failed one opens it again for twice as long (up to
    ``max_open_s``). Neutral outcomes only release the probe slot.

    A probe's verdict comes as early as the call allows: a Generate stream is
    settled by its first message, not by its end (``Instance.settle``), so a
    probe never holds the slot for a whole generation.
    """

    def __init__(
        self, threshold: int = 3, open_s: float = 2.0, max_open_s: float = 30.0, clock: Clock = time.monotonic
    ) -> None:
        if threshold < 1 or open_s <= 0 or max_open_s < open_s:
            raise ValueError("threshold >= 1 and 0 < open_s <= max_open_s are required")
        self.threshold = threshold
        self.open_s = open_s
        self.max_open_s = max_open_s
        self._clock = clock
        self._num_failures = 0
        self._opened_at: float | None = None
        self._current_open_s = open_s
        self._probing = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at < self._current_open_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def allows(self) -> bool:
        """May a new call go to the instance now?"""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._probing)

    def on_start(self) -> bool:
        """A call was sent; True when it is HALF_OPEN's one probe (pass that to ``on_end``)."""
        if self.state is BreakerState.HALF_OPEN and not self._probing:
            self._probing = True
            return True
        return False

    @property
    def probing(self) -> bool:
        """A half-open probe is in flight."""
        return self._probing and self.state is BreakerState.HALF_OPEN

    def on_end(self, outcome: Outcome, *, probe: bool | None = None) -> None:
        """A call's verdict. ``probe``: whether it was the probe (None: any call ending frees the slot)."""
        was_open = self._opened_at is not None
        if probe or probe is None:
            self._probing = False
        if outcome is Outcome.SUCCESS:
            self._num_failures = 0
            self._opened_at = None
            self._current_open_s = self.open_s
        elif outcome is Outcome.FAILURE:
            self._num_failures += 1
            if was_open and self.state is not BreakerState.OPEN:
                # A failed probe: back off longer before the next one.
                self._current_open_s = min(self._current_open_s * 2, self.max_open_s)
                self._opened_at = self._clock()
            elif not was_open and self._num_failures >= self.threshold:
                self._opened_at = self._clock()


class Instance:
    """One backend process and the proxy's view of it.

    ``num_outstanding`` counts this proxy's calls in flight on the instance
    (requests for PD, images for encoders); ``others_load()`` estimates the
    work other proxies put there, from the last GetLoad answer.
    """

    kind = ""
    service_name = ""

    def __init__(
        self,
        address: str,
        channel: grpc.aio.Channel,
        *,
        breaker: CircuitBreaker | None = None,
        clock: Clock = time.monotonic,
        launch_key: str | None = None,
    ) -> None:
        self.address = address
        self.channel = channel
        self.launch_key = launch_key  # ``epd up``'s key this instance must prove before it is ready (launch_proof)
        self.breaker = breaker or CircuitBreaker(clock=clock)
        self.readiness = Readiness.UNKNOWN
        self.num_outstanding = 0
        self.load: object | None = None  # last GetLoad reply (PdLoad / EncoderLoad)
        self.load_baseline = 0  # num_outstanding when that reply was taken
        self.busy_until = 0.0  # RESOURCE_EXHAUSTED retry-after hint
        self.retired = False  # gone from DNS: no new calls; closed when idle
        self._clock = clock
        self.health_stub = health_pb2_grpc.HealthStub(channel)

    # -- routing view -----------------------------------------------------
    def routable(self) -> bool:
        """Not known to be down: ready (or not yet checked, unless it has a launch key to prove first),
        breaker allows, still listed."""
        if self.readiness is Readiness.UNKNOWN and self.launch_key is not None:
            return False
        return not self.retired and self.readiness is not Readiness.NOT_READY and self.breaker.allows()

    def last_resort(self) -> bool:
        """Ready, but its half-open probe is in flight: use it only when nothing else is routable.

        Without this a single-instance pool would refuse every request for as
        long as a probe takes.
        """
        return not self.retired and self.readiness is Readiness.READY and self.breaker.probing

    def healthy(self) -> bool:
        """What ``/health`` reports: SERVING and the breaker not open (a probe in flight counts as healthy)."""
        return not self.retired and self.readiness is Readiness.READY and self.breaker.state is not BreakerState.OPEN

    def is_busy(self) -> bool:
        return self._clock() < self.busy_until

    def mark_busy(self, retry_after_s: float) -> None:
        self.busy_until = self._clock() + retry_after_s

    def reported_load(self) -> int:
        """Work in the instance's own GetLoad answer (0 before the first one)."""
        return 0

    def others_load(self) -> int:
        """Work other proxies had on the instance at the last poll (ours subtracted)."""
        return max(0, self.reported_load() - self.load_baseline)

    def estimated_load(self) -> int:
        """Ours now plus everyone else's as last reported: what least-loaded routing sorts by."""
        return self.num_outstanding + self.others_load()

    # -- writers ------------------------------------------------------------
    def set_readiness(self, readiness: Readiness) -> None:
        if readiness is not self.readiness:
            log.info("%s %s is %s", self.kind, self.address, readiness.name.lower().replace("_", " "))
        self.readiness = readiness

    def set_load(self, load: object) -> None:
        self.load = load
        self.load_baseline = self.num_outstanding

    def begin(self, count: int = 1) -> bool:
        """A call starts (pair with ``end``); True when it is the breaker's half-open probe."""
        self.num_outstanding += count
        return self.breaker.on_start()

    def settle(self, outcome: Outcome, *, probe: bool) -> None:
        """The call's verdict for the breaker before it ends (a stream: at its first message)."""
        self.breaker.on_end(outcome, probe=probe)

    def end(self, outcome: Outcome, count: int = 1, *, probe: bool | None = None, settled: bool = False) -> None:
        """A call ended. After ``settle`` only a failure still counts (a stream that broke later)."""
        self.num_outstanding -= count
        if not settled:
            self.breaker.on_end(outcome, probe=probe)
        elif outcome is Outcome.FAILURE:
            self.breaker.on_end(outcome, probe=False)

    async def get_load(self, timeout: float) -> object:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address})"


def _metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((grpc_utils.REQUEST_ID_KEY, request_id),)


class PdClient(Instance):
    """Client of one PD (``epd.v1.PrefillDecode``)."""

    load: epd_pb2.PdLoad | None

    kind = "pd"
    service_name = PD_SERVICE

    def __init__(self, address: str, channel: grpc.aio.Channel, **kwargs) -> None:
        super().__init__(address, channel, **kwargs)
        self.stub = epd_pb2_grpc.PrefillDecodeStub(channel)
        # Uncached tokens of this proxy's calls in flight here (prompt tokens not in its cache when routed, then
        # output tokens as they come), and their sum when the last GetLoad answered: the cache-aware policy's
        # load (``estimated_tokens``).
        self.outstanding_tokens = 0
        self.tokens_baseline = 0
        # Uncached tokens of this proxy's calls that finished here, decayed: what its conversations bring back.
        self._returning_tokens = 0.0
        self._returning_at = 0.0

    def reported_load(self) -> int:
        load = self.load
        return 0 if load is None else int(load.num_running + load.num_waiting)

    def set_load(self, load: object) -> None:
        super().set_load(load)
        self.tokens_baseline = self.outstanding_tokens

    def hold_tokens(self, num_tokens: int) -> None:
        """``num_tokens`` more uncached tokens of a call in flight here (give them back with ``release_tokens``)."""
        self.outstanding_tokens += num_tokens

    def release_tokens(self, num_tokens: int, *, finished: bool = False) -> None:
        """Gives back what ``hold_tokens`` counted; ``finished``: the call ended with its answer, so its
        tokens count into ``returning_tokens``."""
        self.outstanding_tokens -= num_tokens
        if finished:
            self._returning_tokens = self.returning_tokens() + num_tokens
            self._returning_at = self._clock()

    def returning_tokens(self) -> float:
        """Uncached tokens of the calls that finished here, each halved every ``RETURNING_HALF_LIFE_S``: a
        conversation's next turn goes where its history is cached, so the work a PD served recently is
        work that comes back to it."""
        if not self._returning_tokens:
            return 0.0
        return self._returning_tokens * 0.5 ** ((self._clock() - self._returning_at) / RETURNING_HALF_LIFE_S)

    def reported_tokens(self) -> int:
        """Uncached tokens of the requests running and waiting here at the last GetLoad (0 before it, or from
        a PD that does not report them)."""
        load = self.load
        return 0 if load is None else int(load.num_running_tokens + load.num_waiting_tokens)

    def estimated_tokens(self) -> int:
        """Uncached tokens of the requests here: this proxy's now plus the others' as last reported (ours
        subtracted): the work in flight, in the unit of the cache-aware policy's cost."""
        return self.outstanding_tokens + max(0, self.reported_tokens() - self.tokens_baseline)

    def kv_usage(self) -> float:
        """Fraction of KV blocks in use at the last poll (0 when unknown)."""
        load = self.load
        if load is None or not load.num_kv_blocks_total:
            return 0.0
        return load.num_kv_blocks_used / load.num_kv_blocks_total

    async def get_load(self, timeout: float) -> epd_pb2.PdLoad:
        return await self.stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=timeout)

    async def preallocate(self, request: epd_pb2.PreallocateRequest, *, timeout: float) -> epd_pb2.PreallocateResponse:
        return await self.stub.Preallocate(request, timeout=timeout, metadata=_metadata(request.request_id))

    async def reserve_kv(self, request: epd_pb2.ReserveKVRequest, *, timeout: float) -> epd_pb2.ReserveKVResponse:
        """A decode instance's KV reservation for a prompt (E+P+D)."""
        return await self.stub.ReserveKV(request, timeout=timeout, metadata=_metadata(request.request_id))

    def generate(
        self, request: epd_pb2.GenerateRequest, *, timeout: float
    ) -> grpc.aio.UnaryStreamCall[epd_pb2.GenerateRequest, epd_pb2.GenerateResponse]:
        """Starts the Generate stream; read it with ``call.read()``, stop it with ``call.cancel()``."""
        return self.stub.Generate(request, timeout=timeout, metadata=_metadata(request.request_id))

    def subscribe_cache_events(
        self,
    ) -> grpc.aio.UnaryStreamCall[epd_pb2.SubscribeCacheEventsRequest, epd_pb2.CacheEvents]:
        """Opens the stream of what this PD's caches hold (no deadline: it lasts as long as the PD)."""
        return self.stub.SubscribeCacheEvents(epd_pb2.SubscribeCacheEventsRequest())

    async def abort(self, request_id: str) -> None:
        """Idempotent cancel on PD; failures are swallowed (the lease sweep is the backstop)."""
        try:
            await self.stub.Abort(
                epd_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S, metadata=_metadata(request_id)
            )
        except grpc.aio.AioRpcError:
            pass


class EncoderClient(Instance):
    """Client of one encoder (``epd.v1.Encoder``); ``num_outstanding`` counts images."""

    load: epd_pb2.EncoderLoad | None

    kind = "encoder"
    service_name = ENCODER_SERVICE

    def __init__(self, address: str, channel: grpc.aio.Channel, **kwargs) -> None:
        super().__init__(address, channel, **kwargs)
        self.stub = epd_pb2_grpc.EncoderStub(channel)

    def reported_load(self) -> int:
        return 0 if self.load is None else int(self.load.num_pending)

    async def get_load(self, timeout: float) -> epd_pb2.EncoderLoad:
        return await self.stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=timeout)

    async def encode(self, request: epd_pb2.EncodeRequest, *, timeout: float) -> epd_pb2.EncodeResponse:
        return await self.stub.Encode(request, timeout=timeout, metadata=_metadata(request.request_id))


def serving(reply: health_pb2.HealthCheckResponse) -> Readiness:
    return Readiness.READY if reply.status == health_pb2.HealthCheckResponse.SERVING else Readiness.NOT_READY
