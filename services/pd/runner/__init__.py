"""PD's device runner: everything that touches the model and tensors.

``model_runner.ModelRunner`` executes one ``SchedulerOutput`` (packed or
static decode path), with a step's positions and image rows (``step_inputs``,
``deepstack``), paged attention (``attention``, ``attention_metadata``,
``flex_decode``), CUDA graphs (``decode_graphs``, started as ``decode_plan``
says), sampling (``sampler``, ``penalties``), the CPU linear backend
(``cpu_linear``) and KV cache sizing from device memory (``kv_sizing``).

May import: torch, transformers, ``services.common`` and the engine's hand-off
types (``services.pd.engine``). Never the service shell (servicer, server,
bridge, ...) or grpc. ``lint-imports`` checks this in CI.
"""
