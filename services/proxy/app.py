"""The OpenAI-compatible HTTP app: ``create_app(config, backends)``.

Handlers convert and delegate: body -> validated request -> ``Prompt``
(in a worker thread) -> ``Job`` -> ``Pipeline.generate`` -> OpenAI objects.
All state lives on ``app.state.proxy`` and is built by the lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.pb import epd_pb2
from services.proxy.backends import Backends
from services.proxy.config import ProxyConfig
from services.proxy.errors import ApiError, RequestError, error_body, model_not_found
from services.proxy.http_util import (
    ClientDisconnected,
    EventStreamResponse,
    as_api_error,
    error_response,
    parse_body,
    read_body,
    unless_disconnected,
)
from services.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from services.proxy.pipeline import Job, Pipeline, Trace, new_request_id
from services.proxy.preprocess import Preprocessor, Prompt
from services.proxy.responses import ChatFormatter, CompletionFormatter, ResponseMeta, collect, stream_events
from services.proxy.sampling import (
    check_supported,
    requested_logprobs,
    requested_max_tokens,
    resolve_max_tokens,
    sampling_params,
)
from services.proxy.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ProxyState:
    """Everything handlers need, built once by the lifespan."""

    config: ProxyConfig
    adapter: Any
    preprocessor: Preprocessor
    backends: Backends
    pipeline: Pipeline
    executor: ThreadPoolExecutor
    metrics: ProxyMetrics
    served_model_name: str
    max_model_len: int
    created: int

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise model_not_found()

    async def in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs CPU work (image decoding, tokenization) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    def decode_token(self, token_id: int) -> str:
        return self.preprocessor.tokenizer.decode([token_id])


def _state(request: Request) -> ProxyState:
    return request.app.state.proxy


# --------------------------------------------------------------------------- endpoints


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions`` (text and images, streaming or not)."""
    state, trace = _state(request), Trace()
    body = parse_body(await read_body(request, state.config.max_body_bytes), ChatCompletionRequest)
    state.check_model(body.model)
    check_supported(body)
    prompt = await state.in_worker(state.preprocessor.chat_prompt, body.messages_as_dicts())
    trace.preprocess_ms = (time.monotonic() - trace.started) * 1000
    return await _generate(request, state, body, prompt, trace, ChatFormatter, "chatcmpl")


async def completions(request: Request) -> Response:
    """``POST /v1/completions`` (text-only: a string or a list of token ids)."""
    state, trace = _state(request), Trace()
    body = parse_body(await read_body(request, state.config.max_body_bytes), CompletionRequest)
    state.check_model(body.model)
    check_supported(body)
    prompt_input = body.prompt
    if isinstance(prompt_input, list) and prompt_input and not isinstance(prompt_input[0], int):
        if len(prompt_input) != 1:
            raise RequestError("Only one prompt per request is supported.", "prompt")
        prompt_input = prompt_input[0]
    prompt = await state.in_worker(state.preprocessor.completion_prompt, prompt_input)
    trace.preprocess_ms = (time.monotonic() - trace.started) * 1000
    return await _generate(request, state, body, prompt, trace, CompletionFormatter, "cmpl")


async def _generate(
    request: Request,
    state: ProxyState,
    body: _SamplingFields,
    prompt: Prompt,
    trace: Trace,
    formatter_cls: type[ChatFormatter],
    id_prefix: str,
) -> Response:
    config = state.config
    max_tokens = resolve_max_tokens(
        requested_max_tokens(body), len(prompt.token_ids), state.max_model_len,
        limit=config.max_tokens_limit, default=config.default_max_tokens,
    )
    job = Job(
        request_id=new_request_id(id_prefix),
        prompt=prompt,
        sampling=sampling_params(body, max_tokens),
        deadline=trace.started + config.request_timeout_s,
        trace=trace,
    )
    state.metrics.images.inc(len(prompt.images))
    meta = ResponseMeta(job.request_id, state.served_model_name, state.decode_token, len(prompt.images),
                        return_token_ids=body.return_token_ids)
    formatter = formatter_cls(meta)
    want_logprobs = requested_logprobs(body) is not None
    messages = _observed(state, job, request.url.path)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(
            stream_events(messages, formatter, trace, include_usage=include_usage, want_logprobs=want_logprobs)
        )
    try:
        result = await unless_disconnected(request, collect(messages, formatter, trace, want_logprobs=want_logprobs))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(result)


async def _observed(state: ProxyState, job: Job, endpoint: str) -> AsyncGenerator[epd_pb2.GenerateResponse, None]:
    """``Pipeline.generate`` plus the per-request log line and first-token metric."""
    outcome = "cancelled"
    num_tokens = 0
    try:
        async with contextlib.aclosing(state.pipeline.generate(job)) as messages:
            async for message in messages:
                if num_tokens == 0 and job.trace.first_token_ms is not None:
                    state.metrics.first_token.labels(endpoint).observe(job.trace.first_token_ms / 1000)
                num_tokens += len(message.token_ids)
                if message.finish_reason:
                    outcome = "ok"  # before the yield: the consumer may close us right after
                yield message
    except ApiError as error:
        outcome = f"error {error.status_code} {error.code}"
        raise
    except Exception:
        outcome = "error"
        raise
    finally:
        trace = job.trace
        log.info(
            "request %s %s: %s prompt=%d images=%d ready=%d completion=%d pd=%s first_token_ms=%s total_ms=%.1f",
            job.request_id, endpoint, outcome, len(job.prompt.token_ids), len(job.prompt.images),
            trace.num_images_ready, num_tokens, trace.pd_address,
            None if trace.first_token_ms is None else round(trace.first_token_ms, 1),
            (time.monotonic() - trace.started) * 1000,
        )


async def list_models(request: Request) -> JSONResponse:
    """``GET /v1/models``: the one model this proxy serves."""
    state = _state(request)
    model = {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "epd",
        "max_model_len": state.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [model]})


async def health(request: Request) -> JSONResponse:
    """``GET /health``: 200 when a PD is ready and (if any are configured) an encoder too."""
    state = _state(request)
    report = await state.backends.health(state.config.health_timeout_s)
    pd_ok = any(report["pd"].values())
    encoder_ok = not report["encoder"] or any(report["encoder"].values())
    ok = pd_ok and encoder_ok
    return JSONResponse({"status": "ok" if ok else "unavailable", **report}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


# --------------------------------------------------------------------------- wiring


_GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class _MetricsMiddleware:
    """Counts requests by status and times successful ones, streams included (pure ASGI)."""

    def __init__(self, app: ASGIApp, metrics: ProxyMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in _GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        started, status = time.monotonic(), 500
        self.metrics.in_flight.labels(path).inc()

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            self.metrics.in_flight.labels(path).dec()
            self.metrics.requests.labels(path, str(status)).inc()
            if status < 400:
                self.metrics.duration.labels(path).observe(time.monotonic() - started)


def _install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> Response:
        # ApiError, RequestError, and anything unexpected (a bare 500 that names nothing).
        return error_response(as_api_error(exc))

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        location = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        message = f"{location}: {errors[0]['msg']}" if errors else "Invalid request."
        return JSONResponse(error_body(message, "invalid_request_error", location, "invalid_request"), 400)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
        error_type = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse(error_body(str(getattr(exc, "detail", "")) or "Error.", error_type), status)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_api_error)


def _lifespan(config: ProxyConfig, backends: Backends | None, metrics: ProxyMetrics):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        from services.common.models import load_adapter

        adapter = await asyncio.to_thread(load_adapter, config.model)
        processor = await asyncio.to_thread(adapter.load_processor)
        preprocessor = Preprocessor(
            adapter, processor,
            max_images=config.max_images_per_request, max_image_pixels=config.max_image_pixels,
        )
        owned = backends is None
        pool = backends or Backends.connect(
            config.pd_addresses, config.encoder_addresses, cooldown_s=config.instance_cooldown_s
        )
        pipeline = Pipeline(pool, lease_ms=config.lease_ms)
        executor = ThreadPoolExecutor(config.preprocess_threads, thread_name_prefix="proxy-preprocess")
        app.state.proxy = ProxyState(
            config=config, adapter=adapter, preprocessor=preprocessor, backends=pool, pipeline=pipeline,
            executor=executor, metrics=metrics, served_model_name=config.served_model_name or adapter.model_id,
            max_model_len=min(config.max_model_len or adapter.max_model_len, adapter.max_model_len),
            created=int(time.time()),
        )
        log.info("proxy serving %s: PDs %s, encoders %s", app.state.proxy.served_model_name,
                 [p.address for p in pool.pds], [e.address for e in pool.encoders])
        try:
            yield
        finally:
            await pipeline.drain()
            if owned:
                await pool.close()
            executor.shutdown(wait=False, cancel_futures=True)

    return lifespan


def create_app(config: ProxyConfig, backends: Backends | None = None) -> FastAPI:
    """Builds the proxy app; the lifespan loads the processor and opens channels.

    ``backends``: pools to use instead of connecting to ``config``'s
    addresses (the caller then owns and closes them).
    """
    metrics_ = ProxyMetrics()
    app = FastAPI(title="EPD proxy", version="1", lifespan=_lifespan(config, backends, metrics_), openapi_url=None)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    _install_error_handlers(app)
    app.add_middleware(_MetricsMiddleware, metrics=metrics_)
    return app
