"""``epd bench serve``: the serving benchmark, one module per stage.

``command`` (flags and ``run``), ``layout`` (topologies), ``procs`` (the
cluster as pinned processes), ``workload`` (request schedules), ``client``
(the streaming HTTP client), ``runner`` (the sweep), ``stats`` / ``analysis``
/ ``report`` / ``output`` / ``plots`` (numbers, tables and figures).

May import: ``services.common`` and the other bench modules; services only as
processes, never as Python modules.
"""
