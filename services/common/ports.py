"""Default gRPC ports of the services, in one place.

Both sit below Linux's ephemeral range (``net.ipv4.ip_local_port_range``,
32768–60999 by default) and below Kubernetes' NodePort range (30000–32767):
a port in the ephemeral range may already be held by an outgoing
connection's local end when a service (or one ``epd up`` restarts) binds
it, and the bind then fails at random. ``epd up`` gives encoder *i* the
encoder port + *i* and PD *j* the PD port + *j*.
"""

from __future__ import annotations

DEFAULT_ENCODER_PORT = 21051
"""``epd encoder``'s ``--port``; ``epd up``'s ``--encoder-base-port``."""

DEFAULT_PD_PORT = 21061
"""``epd pd``'s ``--port``; ``epd up``'s ``--pd-base-port``."""

LINUX_EPHEMERAL_PORTS = range(32768, 61000)
"""Linux's default ``ip_local_port_range`` (inclusive 32768–60999): no default port lies in it."""
