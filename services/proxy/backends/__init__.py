"""The backends: the encoder, PD and decode instances the proxy routes to.

``instances`` (one instance: channel, readiness, load, circuit breaker; the PD and encoder clients),
``discovery`` (where the instances are: addresses and DNS names, ``Pool``), ``monitor`` (health watches
and load polling in the background), ``routing`` (the policies that rank instances) and ``pools``
(``Backends``: the pools with their policies, "which instances, best first?").

The lowest wing: may import only ``errors`` and the other shared modules below it, never another wing,
``metrics`` or the shell. Layers: ``services/proxy/__init__.py``.
"""
