"""The OpenAI protocol: what a request may say and what a response looks like.

``schemas`` (the request bodies, pydantic), ``fields`` (every body field honoured or refused),
``sampling`` (request fields -> ``epd.v1.SamplingParams``, with their checks), ``structured``
(structured outputs -> ``epd.v1.StructuredOutput``), ``formatters`` (one choice's chat or text-completion
objects), ``responses`` (PD messages -> the SSE stream or the whole response) and ``openapi`` (the
``/openapi.json`` document).

No HTTP, no backends, no prompt: may import only the shared modules below the wings (``errors``,
``cache_isolation``, ``trace``). Layers: ``services/proxy/__init__.py``.
"""
