"""``ProxyState``: everything the proxy's handlers share, built once by the lifespan on ``app.state.proxy``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from services.proxy.backends.pools import Backends
from services.proxy.cache_isolation import tenant_salt
from services.proxy.config import ProxyConfig
from services.proxy.dispatch.pipeline import Pipeline
from services.proxy.errors import model_not_found
from services.proxy.metrics import ProxyMetrics
from services.proxy.openai.schemas import _SamplingFields
from services.proxy.prompt.media import MediaFetcher
from services.proxy.prompt.preprocess import Preprocessor
from services.proxy.prompt.workers import WorkPool
from services.proxy.web.fairness import ClientLimiter, address_identity, key_identity
from services.proxy.web.middleware import InternalsGuard


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
    video_pool: WorkPool  # video decoding, apart from images (``intake.chat_videos``)
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


def proxy_state(request: Request) -> ProxyState:
    """The app's ``ProxyState`` (set by the lifespan)."""
    return request.app.state.proxy
