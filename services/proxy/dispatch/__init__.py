"""Dispatch: one request's attempts over encoders and PDs, independent of HTTP.

``jobs`` (``Job``: one generation as dispatch sees it), ``calls`` (``Calls``: the Encode calls, and the
job's deadline and lease; what an attempt is handed), ``attempt`` (one try of a job on one PD: Preallocate,
Generate, the Encodes), ``pipeline`` (``Pipeline``: the job loop that admits attempts, fails them over and
cleans them up) and ``handoff`` (E+P+D: an attempt spans a prefill and a decode instance).

Within the wing each module imports only those listed before it: an attempt never calls back into the
pipeline. May import ``prompt`` (the ``Prompt`` a job carries), ``backends`` and the shared modules
(``metrics``, ``errors``, ``trace``); never ``web``, ``openai`` or the shell. Layers:
``services/proxy/__init__.py``.
"""
