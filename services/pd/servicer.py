"""The PrefillDecode gRPC servicer: converts, delegates to the engine, maps errors."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from services.common.grpc_utils import (
    FAILED_HOP_KEY,
    KV_PUSH_HOP,
    MISSING_EXTRA_KEY,
    peer_address,
    request_id_of,
    set_retry_after,
)
from services.common.logs import AccessLine
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.pd import convert
from services.pd.bridge import EngineBridge
from services.pd.cache_feed import CacheFeed
from services.pd.config import PdConfig
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.kv_handoff import Role
from services.pd.engine.outputs import Failed, Finished, SampledToken, TokenDelta
from services.pd.engine.request import Request, RequestStatus
from services.pd.kv_transfer import KVTransfer
from services.pd.push_intake import PushIntake
from services.pd.runner.grammar import (
    MISSING_EXTRA_MESSAGE,
    STRUCTURED_EXTRA,
    GrammarBusy,
    GrammarCompiler,
    GrammarError,
    GrammarUnavailable,
    structured_outputs_installed,
)

log = logging.getLogger(__name__)


class MissingExtraError(EngineError):
    """A request for a feature whose optional dependencies this install lacks.

    FAILED_PRECONDITION (the instance is healthy: no breaker counts it) with
    the ``epd-missing-extra`` trailer naming the pip extra that adds the
    feature, which the proxy turns into a 400 that says so.
    """

    def __init__(self, extra: str, message: str) -> None:
        super().__init__(ErrorKind.FAILED_PRECONDITION, message)
        self.extra = extra


async def abort_with(context: grpc.aio.ServicerContext, error: EngineError, line: AccessLine | None = None) -> None:
    """Ends the call with the status of ``error`` (and a retry-after hint for admission).

    ``line``: the call's access line, which gets the status name.
    """
    code = convert.STATUS_CODES[error.kind]
    if line is not None:
        line.update(status=code.name)
    if error.retry_after_s is not None:
        set_retry_after(context, int(error.retry_after_s * 1000))
    if isinstance(error, MissingExtraError):
        context.set_trailing_metadata(((MISSING_EXTRA_KEY, error.extra),))
    await context.abort(code, error.message)


def _usage_fields(final: epd_pb2.GenerateResponse) -> dict[str, object]:
    """A finished Generate's counts and finish reason, for its access line."""
    usage = final.usage
    return {
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
        "image_tokens": usage.image_tokens,
        "finish_reason": epd_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower(),
    }


class PrefillDecodeServicer(epd_pb2_grpc.PrefillDecodeServicer):
    """Thin adapter between ``epd.v1.PrefillDecode`` and the engine (``EngineBridge``).

    ``draining`` (set by ``PdServer.stop``): new Preallocate and Generate calls
    are refused with UNAVAILABLE, the proxy's cue to use another PD, while
    pushes and aborts for work already admitted are still served.
    """

    def __init__(
        self,
        engine: EngineBridge,
        config: PdConfig,
        *,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        max_model_len: int,
        uses_grids: bool | None = None,
        grammars: GrammarCompiler | None = None,
        tokens_per_second: float | None = None,
        cache_feed: CacheFeed | None = None,
    ):
        """``uses_grids``: the model's multimodal RoPE needs every image item's grid (True), takes
        none (False); None accepts either (servers without a model, such as the transfer bench).
        ``grammars`` compiles structured-output constraints; None refuses them (FAILED_PRECONDITION;
        with the ``epd-missing-extra`` trailer where xgrammar is not installed).
        ``tokens_per_second``: the model's temporal rate for video positions (Qwen2.5-VL); None = 1 a patch.
        ``cache_feed`` serves SubscribeCacheEvents; None refuses it (UNIMPLEMENTED)."""
        self.engine = engine
        self.grammars = grammars
        self.uses_grids = uses_grids
        self.tokens_per_second = tokens_per_second
        self.config = config
        self._live_per_peer: collections.Counter[str] = collections.Counter()  # Generate calls per caller
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.draining = False
        self.pushes = PushIntake(
            engine.hidden_size,
            config.push_idle_timeout_s,
            max_buffer_bytes=config.max_push_buffer_mb << 20,
            max_pushes_per_peer=config.max_pushes_per_peer,
            num_deepstack_levels=engine.num_deepstack_levels,
        )
        self.role = Role(config.role)
        self.cache_feed = cache_feed
        self.kv = KVTransfer(
            engine,
            config,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            uses_grids=uses_grids,
            tokens_per_second=tokens_per_second,
        )

    def _check_admitting(self) -> None:
        if self.draining:
            raise EngineError(ErrorKind.UNAVAILABLE, "this instance is shutting down; use another")

    async def Preallocate(self, request, context):
        with AccessLine(
            log, "preallocate", level=logging.DEBUG, request_id=request_id_of(context), items=len(request.items)
        ) as line:
            try:
                self._check_admitting()
                convert.check_request_id(request.request_id)
                cache_salt = convert.check_cache_salt(request.cache_salt)
                # Cheap checks first: the engine thread hashes the prompt's blocks.
                convert.check_prompt(
                    request.prompt_token_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len
                )
                spans = convert.spans_from_pb(
                    request.items,
                    len(request.prompt_token_ids),
                    max_items=self.config.max_items_per_request,
                    uses_grids=self.uses_grids,
                    tokens_per_second=self.tokens_per_second,
                )
                lease_ms = min(request.lease_ms or self.config.default_lease_ms, self.config.max_lease_ms)
                remaining = context.time_remaining()
                if remaining is not None:
                    lease_ms = max(1, min(lease_ms, int(remaining * 1000)))
                allocations = await self.engine.preallocate(
                    request.request_id,
                    spans,
                    lease_ms / 1000.0,
                    prompt_token_ids=request.prompt_token_ids,
                    peer=peer_address(context),
                    cache_salt=cache_salt,
                )
            except EngineError as error:
                await abort_with(context, error, line)
            return convert.preallocate_to_pb(allocations, lease_ms)

    async def Generate(self, request, context) -> AsyncIterator[epd_pb2.GenerateResponse]:
        # One access line per call, whatever way it ends (status CANCELLED when the client goes away).
        with AccessLine(
            log,
            "generate",
            request_id=request_id_of(context),
            status=None,
            prompt_tokens=len(request.prompt_token_ids),
            image_tokens=None,
            cached_tokens=None,
            completion_tokens=0,
            finish_reason=None,
            ttft_ms=None,
        ) as line:
            try:
                self._check_admitting()
                peer = self._take_peer_slot(context)
            except EngineError as error:
                await abort_with(context, error, line)
                return
            generation = self._generate(request, context, line)
            try:
                async for message in generation:
                    yield message
            finally:
                await generation.aclose()  # its cleanup (the engine's abort) now, not when it is collected
                self._live_per_peer[peer] -= 1
                if not self._live_per_peer[peer]:
                    del self._live_per_peer[peer]

    def _take_peer_slot(self, context) -> str:
        """Counts a Generate against its caller; RESOURCE_EXHAUSTED beyond ``--max-requests-per-peer``."""
        peer = peer_address(context)
        bound = self.config.max_requests_per_peer
        if bound and self._live_per_peer[peer] >= bound:
            raise EngineError(
                ErrorKind.RESOURCE_EXHAUSTED,
                "too many requests from this caller",
                self.config.waiting_retry_after_ms / 1000,
            )
        self._live_per_peer[peer] += 1
        return peer

    async def _generate(self, request, context, line: AccessLine) -> AsyncGenerator[epd_pb2.GenerateResponse, None]:
        """One admitted Generate, from the request to its last message."""
        try:
            engine_request = convert.request_from_pb(
                request,
                eos_token_ids=self.eos_token_ids,
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                max_items=self.config.max_items_per_request,
                uses_grids=self.uses_grids,
                tokens_per_second=self.tokens_per_second,
            )
            handoff = handoff_of(request, engine_request, self.role)
            if handoff is not None:
                await self.kv.check_target(handoff)
            await self._attach_grammar(engine_request)
            events = await self.engine.add_request(engine_request, request.kv_reservation_id)
        except EngineError as error:
            await abort_with(context, error, line)
            return
        done = False
        first_logprobs: list[SampledToken] = []
        try:
            while True:
                event = await events.get()
                if isinstance(event, TokenDelta):
                    first_logprobs = first_logprobs or event.logprobs  # the hand-off sends the first token's
                    line.mark_first_token()
                    line.add("completion_tokens", len(event.token_ids))
                    yield convert.delta_to_pb(event)
                elif isinstance(event, Finished):
                    done = True
                    if event.status == RequestStatus.FINISHED_ABORTED:
                        line.update(status="CANCELLED")
                        await context.abort(grpc.StatusCode.CANCELLED, "request was aborted")
                    if handoff is not None:  # the first token is out: its K/V goes to the decode instance
                        try:
                            logprob = convert.delta_to_pb(TokenDelta([], "", first_logprobs[:1])).logprobs
                            await self.kv.push(
                                engine_request.request_id,
                                handoff,
                                context.time_remaining(),
                                logprob[0] if logprob else None,
                            )
                        except EngineError as error:
                            context.set_trailing_metadata(((FAILED_HOP_KEY, KV_PUSH_HOP),))  # D's hop, not ours
                            await abort_with(context, error, line)
                    final = convert.final_to_pb(event)
                    line.update(status="OK", **_usage_fields(final))
                    yield final
                    return
                elif isinstance(event, Failed):
                    done = True
                    await abort_with(context, event.error, line)
        finally:
            # Client gone, deadline hit or server stopping: free everything.
            if not done:
                self.engine.abort(engine_request.request_id)

    async def _attach_grammar(self, request: Request) -> None:
        """Gives a constrained request its matcher, compiled on the compile thread (the engine thread
        never waits for a schema); INVALID_ARGUMENT for a constraint that does not compile (or not within
        ``--grammar-compile-timeout-s``), RESOURCE_EXHAUSTED beyond ``--max-pending-grammar-compiles``.

        Without a compiler: ``MissingExtraError`` where xgrammar is not installed, else
        FAILED_PRECONDITION (a server without a model, such as the transfer bench's)."""
        spec = request.sampling.structured_output
        if spec is None:
            return
        if self.grammars is None:
            if not structured_outputs_installed():
                raise MissingExtraError(STRUCTURED_EXTRA, MISSING_EXTRA_MESSAGE)
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "this server does not serve structured outputs")
        try:
            # Cancelled (the caller went away) while it waits, its compile is dropped.
            request.grammar = await asyncio.wrap_future(self.grammars.submit(spec))
        except GrammarBusy as error:
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, str(error), error.retry_after_s) from None
        except GrammarUnavailable as error:
            raise EngineError(ErrorKind.UNAVAILABLE, str(error)) from None
        except GrammarError as error:  # one that does not compile, or not within the time bound
            raise EngineError(ErrorKind.INVALID_ARGUMENT, str(error)) from None

    async def PushEmbedding(self, request_iterator, context):
        with AccessLine(log, "push", level=logging.DEBUG, request_id=request_id_of(context)) as line:
            try:
                header, embedding = await self.pushes.receive(request_iterator, peer_address(context))
                line.update(num_bytes=header.num_bytes)
                stored = await self.engine.push(header.request_id, header.reservation_id, header.mm_hash, embedding)
                line.update(repeat=not stored)
            except EngineError as error:
                await abort_with(context, error, line)
            except ValueError as error:
                await abort_with(context, EngineError(ErrorKind.INVALID_ARGUMENT, str(error)), line)
            return epd_pb2.PushEmbeddingResponse(num_bytes=header.num_bytes)

    async def ReserveKV(self, request, context):
        with AccessLine(log, "reserve_kv", level=logging.DEBUG, request_id=request_id_of(context)) as line:
            try:
                self._check_admitting()
                return await self.kv.reserve(request, context.time_remaining(), peer_address(context))
            except EngineError as error:
                await abort_with(context, error, line)
            except asyncio.CancelledError:
                # The caller went away mid-call: a reservation it never learnt of is ended behind the
                # reserve on the engine thread, not left to its lease.
                self.engine.abort(request.request_id)
                raise

    async def PushKV(self, request_iterator, context):
        with AccessLine(log, "push_kv", level=logging.DEBUG, request_id=request_id_of(context)) as line:
            try:
                num_bytes = await self.kv.receive(request_iterator, peer_address(context))
                line.update(num_bytes=num_bytes)
            except EngineError as error:
                await abort_with(context, error, line)
            except ValueError as error:
                await abort_with(context, EngineError(ErrorKind.INVALID_ARGUMENT, str(error)), line)
            return epd_pb2.PushKVResponse(num_bytes=num_bytes)

    async def SubscribeCacheEvents(self, request, context):
        feed = self.cache_feed
        if feed is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server publishes no cache events")
            return
        try:
            async with contextlib.aclosing(feed.stream()) as messages:
                async for message in messages:
                    yield message
        except EngineError as error:
            await abort_with(context, error)

    async def Abort(self, request, context):
        self.engine.abort(request.request_id)
        return epd_pb2.AbortResponse()

    async def GetLoad(self, request, context):
        try:
            stats = await self.engine.shared_stats()  # a caller past its deadline leaves no read of its own
        except EngineError as error:
            await abort_with(context, error)
        return convert.load_to_pb(stats)


def handoff_of(message: epd_pb2.GenerateRequest, request: Request, role: Role) -> epd_pb2.KVHandoff | None:
    """The push target of a prefill instance's half of a hand-off (None: not one); refuses a Generate
    this role does not serve. The prefill half samples one token (``max_tokens`` 1, ``min_tokens`` at
    most 1, so its first token is sampled as the whole request's would be) and holds its K/V for the push."""
    handoff = message.kv_handoff if message.HasField("kv_handoff") else None
    if handoff is not None and message.kv_reservation_id:
        raise EngineError(ErrorKind.INVALID_ARGUMENT, "a Generate is either a hand-off's prefill or its decode")
    if (handoff is not None and not role.prefills) or (message.kv_reservation_id and not role.decodes):
        raise EngineError(ErrorKind.FAILED_PRECONDITION, f"this instance's role is {role.value}")
    if handoff is None and not message.kv_reservation_id and role is not Role.BOTH:
        raise EngineError(ErrorKind.FAILED_PRECONDITION, f"this instance's role is {role.value}: use a KV hand-off")
    if handoff is not None:
        sampling = request.sampling
        request.sampling = dataclasses.replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1))
        request.hand_off_kv = True
    return handoff
