"""``epd bench engine``: PD's engine against ``transformers`` on the same checkpoint.

``command`` (flags, workloads, the report and ``run``); ``runner`` drives
the engine in process; ``hf`` holds the three ``transformers`` baselines it
is compared with.

May import: ``services.common``, ``services.pd`` (the engine is measured in
process) and ``transformers``.
"""
