"""HTTP plumbing: what every request meets on its way in and out, whatever it asks for.

``middleware`` (API key, request metrics, access lines, OpenAI-shaped errors for everything),
``http_util`` (bounded body reading, body checks and parsing, disconnect watching),
``bounded_responses`` (bounded response writes and the SSE response) and ``fairness`` (per-client
limits: requests in flight and a token bucket).

May import ``openai`` (the request bodies' field names) and the shared modules (``metrics``, ``errors``,
``trace``); never ``dispatch``, ``prompt`` or the shell. Layers: ``services/proxy/__init__.py``.
"""
