"""PD's engine: a request's whole life on PD, in pure Python.

``core.EngineCore`` owns the request lifecycle (preallocate, push, generate,
step, release) and ``scheduler.Scheduler`` decides each step; beside them live
the two caches (``kv_cache``, ``embedding_cache``), what a Preallocate leaves
for its Generate (``preallocated``, with lease deadlines in ``leases``), the
step budget (``step_budget``, ``slo``) and its time model, detokenizing
streams and the typed hand-offs (``outputs``).

May import: the standard library and ``services.common`` helpers that are
pure Python. Never torch, numpy, grpc, ``services.pd.runner`` or the service
shell (``services.pd.*``): tensors live only in the runner, wire formats only
in the shell. ``lint-imports`` checks this in CI.
"""
