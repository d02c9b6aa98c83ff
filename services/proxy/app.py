"""The OpenAI-compatible HTTP app: ``create_app(config, backends)``.

Handlers convert and delegate: body -> validated request -> image sources
(remote ones fetched) -> ``Prompt`` -> one ``Job`` per choice ->
``Pipeline.generate`` -> OpenAI objects. The prompt is built on two bounded
pools (``workers``): the text stage on the text pool, the image stage on
the image pool, so image work never delays a text-only request and a full
queue is a 503, not an unbounded backlog. All state lives on
``app.state.proxy`` and is built by the lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.common import launch_proof
from services.common.logs import AccessLine
from services.common.pb import epd_pb2
from services.proxy import intake
from services.proxy.backends import Backends
from services.proxy.cache_isolation import tenant_salt
from services.proxy.config import ProxyConfig
from services.proxy.errors import ApiError, RequestError, invalid_api_key, model_not_found
from services.proxy.fairness import (
    REFUSAL_REASONS,
    Admission,
    ClientLimiter,
    FairnessLimits,
    address_identity,
    key_identity,
)
from services.proxy.fields import ignored_fields_header
from services.proxy.handoff import HandoffPipeline
from services.proxy.http_util import (
    BoundedJSONResponse,
    ClientDisconnected,
    EventStreamResponse,
    WriteBound,
    check_json_content_type,
    request_timeout,
    unless_disconnected,
)
from services.proxy.jobs import Job, Trace, new_request_id
from services.proxy.media import MediaFetcher, MediaPolicy, image_sources
from services.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from services.proxy.middleware import (
    AccessLogMiddleware,
    ApiKeyMiddleware,
    InternalsGuard,
    MetricsMiddleware,
    access_line,
    install_error_handlers,
)
from services.proxy.openapi import openapi_document
from services.proxy.pipeline import Pipeline, StallLimits
from services.proxy.preprocess import Preprocessor, Prompt
from services.proxy.responses import (
    ChatFormatter,
    Choice,
    CompletionFormatter,
    ResponseMeta,
    collect,
    stream_events,
)
from services.proxy.sampling import (
    choice_sampling,
    requested_logprobs,
    requested_max_tokens,
    resolve_max_tokens,
    sampling_params,
)
from services.proxy.schemas import (
    _SamplingFields,
)
from services.proxy.videos import video_refs
from services.proxy.workers import WorkPool

log = logging.getLogger(__name__)


@dataclass
class ProxyState:
    """Everything handlers need, built once by the lifespan."""

    config: ProxyConfig
    adapter: Any
    preprocessor: Preprocessor
    backends: Backends
    pipeline: Pipeline
    text_pool: WorkPool
    image_pool: WorkPool
    metrics: ProxyMetrics
    fetcher: MediaFetcher | None
    served_model_name: str
    max_model_len: int
    created: int
    guard: InternalsGuard
    limiter: ClientLimiter  # per-client limits (off unless configured)

    def client_identity(self, request: Request) -> str:
        """Who a request counts against: the API key's hash when keys are required, else the peer address."""
        if self.config.api_key is not None:  # ApiKeyMiddleware let only this key through
            return key_identity(self.config.api_key)
        return address_identity(request.client.host if request.client else None)

    def cache_salt(self, request: Request, body: _SamplingFields) -> str:
        """The request's wire cache salt: its tenant under ``--cache-isolation`` and its ``cache_salt``."""
        return tenant_salt(self.config.cache_isolation, self.client_identity(request), body.cache_salt)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise model_not_found()

    def decode_token(self, token_id: int) -> str:
        return self.preprocessor.tokenizer.decode([token_id])

    def model_object(self) -> dict[str, Any]:
        """The OpenAI model object of the one model this proxy serves."""
        return {
            "id": self.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "epd",
            "max_model_len": self.max_model_len,
        }


def _state(request: Request) -> ProxyState:
    return request.app.state.proxy


@dataclass(frozen=True)
class _Checked:
    """One generation request, checked and preprocessed: what an endpoint hands ``_generate``."""

    body: _SamplingFields
    prompt: Prompt
    trace: Trace
    timeout_s: float
    formatter_cls: type[ChatFormatter]
    id_prefix: str
    ignored_fields: list[str]  # named in X-EPD-Ignored-Fields
    echo_text: str = ""  # completions' echo

    @property
    def deadline(self) -> float:
        return self.trace.started + self.timeout_s


# --------------------------------------------------------------------------- endpoints


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions`` (text and images, streaming or not)."""
    state, trace = _state(request), Trace()
    timeout_s = request_timeout(request, state.config.request_timeout_s)
    raw = await intake.read_request_body(request, state, trace.started + timeout_s)
    check_json_content_type(request)
    body, ignored, messages, urls = await intake.off_loop_if_large(
        state, raw, trace.started + timeout_s, intake.read_chat, state, raw
    )
    sources = await image_sources(urls, state.fetcher, trace.started + timeout_s - time.monotonic())
    deadline = trace.started + timeout_s
    token_ids = await state.text_pool.run(
        state.preprocessor.chat_tokens, messages, body.chat_template_kwargs, deadline=deadline
    )
    salt = state.cache_salt(request, body)
    images = (
        await state.image_pool.run(state.preprocessor.chat_images, sources, salt, deadline=deadline) if sources else ()
    )
    del sources  # the image bytes are no longer needed
    videos = await intake.chat_videos(state, body, video_refs(messages), salt, deadline)
    prompt = state.preprocessor.assemble(token_ids, images, salt, videos)
    trace.preprocess_ms = (time.monotonic() - trace.started) * 1000
    return await _generate(request, state, _Checked(body, prompt, trace, timeout_s, ChatFormatter, "chatcmpl", ignored))


async def completions(request: Request) -> Response:
    """``POST /v1/completions`` (text-only: a string or a list of token ids)."""
    state, trace = _state(request), Trace()
    timeout_s = request_timeout(request, state.config.request_timeout_s)
    raw = await intake.read_request_body(request, state, trace.started + timeout_s)
    check_json_content_type(request)
    body, ignored = await intake.off_loop_if_large(
        state, raw, trace.started + timeout_s, intake.read_completion, state, raw
    )
    prompt_input = body.prompt
    if isinstance(prompt_input, list) and prompt_input and not isinstance(prompt_input[0], int):
        if len(prompt_input) != 1:
            raise RequestError("Only one prompt per request is supported.", "prompt")
        prompt_input = prompt_input[0]
    prompt = await state.text_pool.run(
        state.preprocessor.completion_prompt,
        prompt_input,
        state.cache_salt(request, body),
        deadline=trace.started + timeout_s,
    )
    echo_text = ""
    if body.echo:  # the prompt as sent; a token-id prompt decoded
        echo_text = prompt_input if isinstance(prompt_input, str) else state.preprocessor.tokenizer.decode(prompt_input)
    trace.preprocess_ms = (time.monotonic() - trace.started) * 1000
    checked = _Checked(body, prompt, trace, timeout_s, CompletionFormatter, "cmpl", ignored, echo_text)
    return await _generate(request, state, checked)


async def _generate(request: Request, state: ProxyState, checked: _Checked) -> Response:
    """One job per choice (``n``), all under the request's one deadline, once the client's limits admit it."""
    body, prompt = checked.body, checked.prompt
    max_tokens = resolve_max_tokens(
        requested_max_tokens(body),
        len(prompt.token_ids),
        state.max_model_len,
        limit=state.config.max_tokens_limit,
        default=state.config.default_max_tokens,
    )
    admission = state.limiter.admit(
        state.client_identity(request),
        num_choices=body.n or 1,
        prompt_tokens=len(prompt.token_ids),
        max_tokens=max_tokens,
    )
    # The admission is released on every exit: here, or by a stream's response when it ends (``on_close``).
    handed_over = False
    try:
        response = await _respond(request, state, checked, max_tokens, admission)
        handed_over = isinstance(response, EventStreamResponse)
        return response
    finally:
        if not handed_over:
            admission.release()


async def _respond(
    request: Request, state: ProxyState, checked: _Checked, max_tokens: int, admission: Admission
) -> Response:
    """``_generate`` once admitted: builds the jobs and answers (a stream's response owns ``admission``)."""
    config, body, prompt, trace = state.config, checked.body, checked.prompt, checked.trace
    request_id = new_request_id(checked.id_prefix)
    line = access_line(request)
    if line is not None:
        line.update(
            request_id=request_id,
            model=state.served_model_name,
            stream=bool(body.stream),
            images=len(prompt.images),
            prompt_tokens=len(prompt.token_ids),
            completion_tokens=0,
            ttft_ms=None,
            outcome="ok",
        )
    sampling = sampling_params(body, max_tokens)
    jobs = [
        Job(
            request_id=request_id if index == 0 else f"{request_id}-n{index}",
            prompt=prompt,
            sampling=choice_sampling(sampling, index),
            deadline=checked.deadline,
            trace=trace if index == 0 else Trace(started=trace.started, preprocess_ms=trace.preprocess_ms),
        )
        for index in range(body.n or 1)
    ]
    state.metrics.images.inc(len(prompt.images))
    meta = ResponseMeta(
        request_id,
        state.served_model_name,
        state.decode_token,
        len(prompt.images),
        num_video_tokens=prompt.num_video_tokens,
        return_token_ids=body.return_token_ids,
        hide_cache_details=config.hide_cache_details,
        echo_text=checked.echo_text,
    )
    formatter = checked.formatter_cls(meta)
    want_logprobs = requested_logprobs(body) is not None
    # A client that streams sees tokens as they come; one that does not sees
    # nothing until the end, so its jobs may restart on another PD mid-way.
    choices = [
        Choice(
            _observed(state, job, request.url.path, buffered=not body.stream, line=line, admission=admission),
            job.trace,
        )
        for job in jobs
    ]
    stalled_writes = state.metrics.stalls.labels("write")
    bound = WriteBound(checked.deadline, config.write_timeout_s, stalled_writes.inc)
    headers = ignored_fields_header(checked.ignored_fields)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(
            stream_events(choices, formatter, include_usage=include_usage, want_logprobs=want_logprobs),
            headers=headers,
            bound=bound,
            on_close=admission.release,
        )
    try:
        result = await unless_disconnected(request, collect(choices, formatter, want_logprobs=want_logprobs))
    except ClientDisconnected:
        return Response(status_code=499)
    return BoundedJSONResponse(result, bound=bound, headers=headers)


def default_served_name(model: str, model_id: str) -> str:
    """A built-in preset is served under its preset name ("tiny"); anything else under its model id."""
    from services.common.models.presets import PRESETS

    name = model or "tiny"
    return name if name in PRESETS else model_id


async def _observed(
    state: ProxyState,
    job: Job,
    endpoint: str,
    *,
    buffered: bool,
    line: AccessLine | None = None,
    admission: Admission | None = None,
) -> AsyncGenerator[epd_pb2.GenerateResponse, None]:
    """``Pipeline.generate`` plus the first-token metric, a per-choice debug line and the access line's counts."""
    outcome, error_code = "cancelled", None
    num_tokens = 0
    gaps = state.metrics.token_gaps(endpoint, enabled=not buffered)  # buffered tokens arrive all at once
    try:
        async with contextlib.aclosing(state.pipeline.generate(job, buffered=buffered)) as messages:
            async for message in messages:
                if num_tokens == 0 and job.trace.first_token_ms is not None:
                    state.metrics.first_token.labels(endpoint).observe(job.trace.first_token_ms / 1000)
                gaps.add(len(message.token_ids))
                num_tokens += len(message.token_ids)
                if admission is not None:
                    admission.add_used(len(message.token_ids))
                if message.finish_reason:
                    outcome = "ok"  # before the yield: the consumer may close us right after
                yield message
    except ApiError as error:
        outcome, error_code = "error", f"{error.status_code}_{error.code}"
        raise
    except Exception:
        outcome = "error"
        raise
    finally:
        trace = job.trace
        if line is not None:
            _note_choice(line, trace, num_tokens, outcome, error_code)
        log.debug(
            "request %s %s: %s %s prompt=%d images=%d ready=%d encoder_hits=%d completion=%d pd=%s attempts=%d "
            "first_token_ms=%s total_ms=%.1f",
            job.request_id,
            endpoint,
            outcome,
            error_code or "",
            len(job.prompt.token_ids),
            len(job.prompt.images),
            trace.num_images_ready,
            trace.num_encoder_cache_hits,
            num_tokens,
            trace.pd_address,
            trace.num_pd_attempts,
            None if trace.first_token_ms is None else round(trace.first_token_ms, 1),
            (time.monotonic() - trace.started) * 1000,
        )


def _note_choice(line: AccessLine, trace: Trace, num_tokens: int, outcome: str, error_code: str | None) -> None:
    """Adds one choice's counts to the request's access line (``n`` > 1: summed; the first failure kept).

    ``outcome``: ok, cancelled or error; a stream that failed after its 200 says so only here.
    """
    line.add("completion_tokens", num_tokens)
    line.add("pd_attempts", trace.num_pd_attempts)
    line.update(pd=trace.pd_address)
    if line.fields.get("ttft_ms") is None and trace.first_token_ms is not None:
        line.update(ttft_ms=trace.first_token_ms)
    if line.fields.get("outcome") == "ok" and outcome != "ok":
        line.update(outcome=outcome, error_code=error_code)


async def list_models(request: Request) -> JSONResponse:
    """``GET /v1/models``: the one model this proxy serves."""
    return JSONResponse({"object": "list", "data": [_state(request).model_object()]})


async def retrieve_model(request: Request) -> JSONResponse:
    """``GET /v1/models/{model_id}``: the served model's object, or a 404 that does not repeat the id."""
    state = _state(request)
    if request.path_params["model_id"] != state.served_model_name:
        raise model_not_found("model_id")
    return JSONResponse(state.model_object())


async def health(request: Request) -> JSONResponse:
    """``GET /health``: 200 when a PD is ready and (if any are configured) an encoder and a decode PD too.

    Read from the health monitor's state (no calls are made here). The
    per-instance report names backend addresses, so behind ``--api-key`` it
    is shown only to an authenticated caller; the status is for everyone.
    """
    state = _state(request)
    report = state.backends.health_report()
    pd_ok = any(report["pd"].values())
    encoder_ok = not state.backends.has_encoders or any(report["encoder"].values())
    decode_ok = "decode" not in report or any(report["decode"].values())  # E+P+D needs a decode PD too
    ok = pd_ok and encoder_ok and decode_ok
    body = {"status": "ok" if ok else "unavailable", **(report if state.guard.allows(request) else {})}
    headers = {}
    launch_key = state.config.security.launch_key
    if launch_key is not None:  # ``epd up`` asks who answers on this port (services/common/launch_proof.py)
        proof = launch_proof.answer(launch_key, list(request.headers.items()))
        if proof is not None:
            headers[launch_proof.PROOF_METADATA_KEY] = proof
    return JSONResponse(body, status_code=200 if ok else 503, headers=headers)


async def live(request: Request) -> JSONResponse:
    """``GET /health/live``: 200 whenever this process's event loop answers, whatever the backends do.

    The liveness probe's endpoint: a TCP probe passes while the loop is
    blocked (the kernel completes the handshake from the listen backlog),
    and ``/health`` fails during a backend outage, which a restart of the
    proxy would not mend. It names nothing and needs no secret.
    """
    return JSONResponse({"status": "alive"})


async def metrics(request: Request) -> Response:
    """``GET /metrics``: behind ``--api-key`` it needs the key, with ``--metrics-require-token`` and no key it
    is closed; with ``--metrics-port`` it is served there only (404 here)."""
    state = _state(request)
    if state.config.metrics_port >= 0:
        raise StarletteHTTPException(404)
    if not state.guard.allows(request):
        raise invalid_api_key()
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


# --------------------------------------------------------------------------- wiring


def _lifespan(config: ProxyConfig, backends: Backends | None, fetcher: MediaFetcher | None, metrics: ProxyMetrics):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        from services.common.models.cache import ensure_model_in_child
        from services.common.models.supported import load_processing

        # The torch-free half of the adapter; a missing built-in model is built in a child process.
        adapter = await asyncio.to_thread(lambda: load_processing(str(ensure_model_in_child(config.model))))
        processor = await asyncio.to_thread(adapter.load_processor)
        max_model_len = min(config.max_model_len or adapter.max_model_len, adapter.max_model_len)
        preprocessor = Preprocessor(
            adapter,
            processor,
            max_images=config.max_images_per_request,
            max_image_pixels=config.max_image_pixels,
            max_request_pixels=config.max_request_pixels,
            max_model_len=max_model_len,
            faults=config.faults,
            video_limits=config.video_limits(),
        )
        if config.faults.enabled:
            log.warning("FAULT INJECTION ENABLED (test only): %s", config.faults.describe())
        owned = backends is None
        pool = backends or Backends.connect(config)
        await pool.start()
        metrics.watch_instances(lambda: [*pool.pds, *pool.encoders, *pool.decodes])
        pipeline = (HandoffPipeline if config.decode_addresses else Pipeline)(
            pool,
            lease_ms=config.lease_ms,
            pd_attempts=config.pd_attempts,
            encoder_attempts=config.encoder_attempts,
            metrics=metrics,
            stall_limits=StallLimits(
                config.first_token_timeout_s, config.inter_token_timeout_s, config.encode_timeout_s
            ),
        )
        media = fetcher
        if media is None and config.allowed_media_domains:
            media = MediaFetcher(
                MediaPolicy(config.allowed_media_domains, config.media_timeout_s, config.max_media_bytes)
            )
        refusals = metrics.client_limit_refusals
        for reason in REFUSAL_REASONS:
            refusals.labels(reason)  # exported at 0 from the start
        limiter = ClientLimiter(
            FairnessLimits(config.max_requests_per_client, config.max_tokens_per_client_per_minute),
            on_refusal=lambda reason: refusals.labels(reason).inc(),
        )
        text_pool = WorkPool("text", config.preprocess_threads, config.text_queue)
        image_pool = WorkPool("image", config.image_threads, config.image_queue)
        app.state.proxy = ProxyState(
            config=config,
            adapter=adapter,
            preprocessor=preprocessor,
            backends=pool,
            pipeline=pipeline,
            text_pool=text_pool,
            image_pool=image_pool,
            metrics=metrics,
            fetcher=media,
            served_model_name=config.served_model_name or default_served_name(config.model, adapter.model_id),
            max_model_len=max_model_len,
            created=int(time.time()),
            guard=InternalsGuard(config.api_key, require_token=config.security.metrics_auth),
            limiter=limiter,
        )
        scrape_port = None
        if config.metrics_port >= 0:
            host = config.metrics_host or config.host
            scrape_port = await metrics.serve(host, config.metrics_port, token=config.security.metrics_token)
        app.state.metrics_http = scrape_port
        log.info(
            "proxy serving %s: PDs %s, encoders %s (policies %s / %s)",
            app.state.proxy.served_model_name,
            [p.address for p in pool.pds],
            [e.address for e in pool.encoders],
            config.pd_policy,
            config.encoder_policy,
        )
        try:
            yield
        finally:
            if scrape_port is not None:
                await scrape_port.stop()
            await pipeline.drain()
            if owned:
                await pool.close()
            if media is not None and fetcher is None:
                await media.aclose()
            text_pool.shutdown()
            image_pool.shutdown()

    return lifespan


def create_app(
    config: ProxyConfig, backends: Backends | None = None, *, fetcher: MediaFetcher | None = None
) -> FastAPI:
    """Builds the proxy app; the lifespan loads the processor and opens channels.

    ``backends``: pools to use instead of connecting to ``config``'s
    addresses (the caller then owns and closes them). ``fetcher``: the
    remote-image fetcher to use (tests inject a resolver and transport);
    by default one is built when ``config.allowed_media_domains`` is set.
    """
    metrics_ = ProxyMetrics()
    # /openapi.json describes the API (services/proxy/openapi.py); no HTML docs pages.
    app = FastAPI(
        title="EPD proxy",
        version="1",
        openapi_url="/openapi.json",
        docs_url=None,
        redoc_url=None,
        lifespan=_lifespan(config, backends, fetcher, metrics_),
    )
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    # ``:path``: a served name may contain "/" (a Hugging Face id), which clients send unescaped.
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/health/live", live, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.openapi = functools.partial(openapi_document, app, config)
    install_error_handlers(app)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(AccessLogMiddleware)  # outside the API key check: refused requests get a line too
    app.add_middleware(MetricsMiddleware, metrics=metrics_)  # outermost: counts refused requests too
    return app
