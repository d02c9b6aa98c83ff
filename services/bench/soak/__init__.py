"""``epd bench soak``: a bounded Locust soak with process kills, leak and memory checks.

``command`` (flags and ``run``), ``faults`` (the kills it injects), ``report``
(Locust outcomes, RSS, the markdown report).

May import: ``services.common`` and ``services.bench.serve`` (its process
layer); services only as processes, never as Python modules.
"""
