"""Encoder domain errors and the one interceptor that turns them into gRPC status codes.

Code below the servicer raises these; nothing else in the encoder calls
``context.abort``. Messages are fixed strings or counts: they never echo
request input (pixels, hashes, ids).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc

from services.common.grpc_utils import FAILED_HOP_KEY, PUSH_HOP, set_retry_after

log = logging.getLogger(__name__)


class EncoderError(Exception):
    """Base of every error the encoder reports to its caller as a status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidInput(EncoderError):
    """The request is malformed (INVALID_ARGUMENT)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class PdNotAllowed(EncoderError):
    """The Encode names a PD that is not on the allow-list (PERMISSION_DENIED): the caller may not
    send this encoder, and its token, there. The address is not repeated."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Overloaded(EncoderError):
    """The pending queue is full (RESOURCE_EXHAUSTED + ``retry-after-ms``)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class DeadlineExceeded(EncoderError):
    """The request's deadline passed before its work could run (DEADLINE_EXCEEDED)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class EncodeFailed(EncoderError):
    """The vision forward failed (INTERNAL); the worker keeps serving other batches."""

    code = grpc.StatusCode.INTERNAL


class ShuttingDown(EncoderError):
    """The encoder is stopping and dropped queued work (UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE


class PushFailed(EncoderError):
    """Pushing an embedding to PD failed; ``code`` is what the caller sees.

    Reported with the trailer ``epd-failed-hop: pd-push`` so that the proxy
    charges PD, not this encoder, for it.

    ``sent`` is False when PD never received the header, i.e. the push was
    not accepted at all and may be retried.
    """

    def __init__(self, message: str, code: grpc.StatusCode, *, sent: bool = True) -> None:
        super().__init__(message, code)
        self.sent = sent


Handler = Callable[[object, grpc.aio.ServicerContext], Awaitable[object]]


def _map_errors(behavior: Handler) -> Handler:
    async def wrapped(request: object, context: grpc.aio.ServicerContext) -> object:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except EncoderError as err:
            if isinstance(err, Overloaded):
                set_retry_after(context, err.retry_after_ms)
            elif isinstance(err, PushFailed):
                # The encoder did its part; the caller must not charge it for PD's answer
                # or for a path to PD that is down.
                context.set_trailing_metadata(((FAILED_HOP_KEY, PUSH_HOP),))
            await context.abort(err.code, err.message)
        except Exception:
            # Anything unexpected is a bug: log it with its traceback, tell the
            # caller only that it happened.
            log.exception("unhandled error in encoder RPC")
            await context.abort(grpc.StatusCode.INTERNAL, "internal encoder error")
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    return wrapped


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps :class:`EncoderError` (and unexpected exceptions) of Encoder RPCs to status codes.

    Only ``epd.v1.Encoder`` methods are wrapped (all unary); the health
    service passes through untouched.
    """

    SERVICE_PREFIX = "/epd.v1.Encoder/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler.unary_unary is None
            or not handler_call_details.method.startswith(self.SERVICE_PREFIX)
        ):
            return handler
        return grpc.unary_unary_rpc_method_handler(
            # grpc's stubs type a handler's behaviour as synchronous; on this asyncio server it is
            # a coroutine function taking the asyncio context.
            _map_errors(cast(Handler, handler.unary_unary)),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
