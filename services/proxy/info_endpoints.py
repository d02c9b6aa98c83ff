"""The proxy's read-only endpoints: the model list, health, liveness and ``/metrics``.

None of them touches a backend; they read ``ProxyState`` (the health
monitor's last report, the metrics registry).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.common import launch_proof
from services.proxy.errors import invalid_api_key, model_not_found
from services.proxy.metrics import CONTENT_TYPE
from services.proxy.state import proxy_state


async def list_models(request: Request) -> JSONResponse:
    """``GET /v1/models``: the one model this proxy serves."""
    return JSONResponse({"object": "list", "data": [proxy_state(request).model_object()]})


async def retrieve_model(request: Request) -> JSONResponse:
    """``GET /v1/models/{model_id}``: the served model's object, or a 404 that does not repeat the id."""
    state = proxy_state(request)
    if request.path_params["model_id"] != state.served_model_name:
        raise model_not_found("model_id")
    return JSONResponse(state.model_object())


async def health(request: Request) -> JSONResponse:
    """``GET /health``: 200 when a PD is ready and (if any are configured) an encoder and a decode PD too.

    Read from the health monitor's state (no calls are made here). The
    per-instance report names backend addresses, so behind ``--api-key`` it
    is shown only to an authenticated caller; the status is for everyone.
    """
    state = proxy_state(request)
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
    state = proxy_state(request)
    if state.config.metrics_port >= 0:
        raise StarletteHTTPException(404)
    if not state.guard.allows(request):
        raise invalid_api_key()
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
