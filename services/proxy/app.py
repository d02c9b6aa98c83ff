"""The OpenAI-compatible HTTP app: ``create_app(config, backends)``.

Handlers convert and delegate: body -> validated request -> image sources
(remote ones fetched) -> ``Prompt`` -> one ``Job`` per choice ->
``Pipeline.generate`` -> OpenAI objects. The prompt is built on two bounded
pools (``prompt.workers``): the text stage on the text pool, the image stage on
the image pool, so image work never delays a text-only request and a full
queue is a 503, not an unbounded backlog. All state lives on
``app.state.proxy`` (``services.proxy.state``) and is built by the lifespan
(``services.proxy.lifespan``); the read-only endpoints (models, health,
metrics) are in ``services.proxy.info_endpoints``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from services.common.logs import AccessLine
from services.common.pb import epd_pb2
from services.proxy import intake
from services.proxy.backends.pools import Backends
from services.proxy.config import ProxyConfig
from services.proxy.dispatch.jobs import Job
from services.proxy.errors import ApiError, RequestError
from services.proxy.info_endpoints import health, list_models, live, metrics, retrieve_model
from services.proxy.lifespan import proxy_lifespan
from services.proxy.metrics import ProxyMetrics
from services.proxy.openai.fields import ignored_fields_header
from services.proxy.openai.formatters import ChatFormatter, CompletionFormatter, ResponseMeta
from services.proxy.openai.openapi import openapi_document
from services.proxy.openai.responses import Choice, collect, stream_events
from services.proxy.openai.sampling import (
    choice_sampling,
    requested_logprobs,
    requested_max_tokens,
    resolve_max_tokens,
    sampling_params,
)
from services.proxy.openai.schemas import _SamplingFields
from services.proxy.prompt.media import MediaFetcher, image_sources
from services.proxy.prompt.preprocess import Prompt
from services.proxy.prompt.videos import video_refs
from services.proxy.state import ProxyState, proxy_state
from services.proxy.trace import Trace, new_request_id
from services.proxy.web.bounded_responses import BoundedJSONResponse, EventStreamResponse, WriteBound
from services.proxy.web.fairness import Admission
from services.proxy.web.http_util import (
    ClientDisconnected,
    check_json_content_type,
    request_timeout,
    unless_disconnected,
)
from services.proxy.web.middleware import (
    AccessLogMiddleware,
    ApiKeyMiddleware,
    MetricsMiddleware,
    access_line,
    install_error_handlers,
)

log = logging.getLogger(__name__)


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
    state, trace = proxy_state(request), Trace()
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
    state, trace = proxy_state(request), Trace()
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


def _jobs(checked: _Checked, request_id: str, max_tokens: int) -> list[Job]:
    """One job per choice (``n``); the first carries the request's own id and trace."""
    body, prompt, trace = checked.body, checked.prompt, checked.trace
    sampling = sampling_params(body, max_tokens)
    return [
        Job(
            request_id=request_id if index == 0 else f"{request_id}-n{index}",
            prompt=prompt,
            sampling=choice_sampling(sampling, index),
            deadline=checked.deadline,
            trace=trace if index == 0 else Trace(started=trace.started, preprocess_ms=trace.preprocess_ms),
        )
        for index in range(body.n or 1)
    ]


async def _respond(
    request: Request, state: ProxyState, checked: _Checked, max_tokens: int, admission: Admission
) -> Response:
    """``_generate`` once admitted: builds the jobs and answers (a stream's response owns ``admission``)."""
    config, body, prompt = state.config, checked.body, checked.prompt
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
    jobs = _jobs(checked, request_id, max_tokens)
    state.metrics.images.inc(len(prompt.images))
    meta = ResponseMeta(
        request_id,
        state.served_model_name,
        state.decode_token,
        len(prompt.images),
        num_video_tokens=prompt.num_video_tokens,
        return_token_ids=body.return_token_ids,
        prompt_token_ids=list(prompt.token_ids) if body.return_token_ids else [],
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
    if trace.route_reason is not None:  # the cache-aware policy's
        line.update(pd_route=trace.route_reason, pd_cache_hit_tokens=trace.route_hit_tokens)
    if line.fields.get("ttft_ms") is None and trace.first_token_ms is not None:
        line.update(ttft_ms=trace.first_token_ms)
    if line.fields.get("outcome") == "ok" and outcome != "ok":
        line.update(outcome=outcome, error_code=error_code)


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
    # /openapi.json describes the API (services/proxy/openai/openapi.py); no HTML docs pages.
    app = FastAPI(
        title="EPD proxy",
        version="1",
        openapi_url="/openapi.json",
        docs_url=None,
        redoc_url=None,
        lifespan=proxy_lifespan(config, backends, fetcher, metrics_),
    )
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    # ``:path``: a served name may contain "/" (a Hugging Face id), which clients send unescaped.
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/health/live", live, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.openapi = functools.partial(  # type: ignore[method-assign]  # FastAPI documents replacing it
        openapi_document, app, max_tokens_limit=config.max_tokens_limit, max_n=config.max_n
    )
    install_error_handlers(app)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(AccessLogMiddleware)  # outside the API key check: refused requests get a line too
    app.add_middleware(MetricsMiddleware, metrics=metrics_)  # outermost: counts refused requests too
    return app
