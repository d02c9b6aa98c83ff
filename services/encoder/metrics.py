"""The metrics seam of the encoder.

The batcher, pusher and servicer report events to an ``EncoderMetrics``;
this base class ignores them. The Prometheus exporter (a later component)
subclasses it and is passed to ``start_encoder``; nothing else changes.
Methods are called from the event loop, except ``on_batch`` and
``on_dropped`` which the worker thread calls, so implementations must be
thread-safe.
"""

from __future__ import annotations


class EncoderMetrics:
    """No-op event sink; override the methods to export metrics."""

    def on_batch(self, num_images: int, forward_s: float, ok: bool) -> None:
        """A vision forward over ``num_images`` images finished (worker thread)."""

    def on_dropped(self, num_images: int, reason: str) -> None:
        """Queued images were dropped at dequeue (``reason``: deadline, cancelled, shutdown)."""

    def on_rejected(self) -> None:
        """An Encode call was refused because the pending queue was full."""

    def on_item(self, cache_hit: bool, encode_s: float, push_s: float) -> None:
        """One Encode item finished successfully."""

    def on_request(self, code_name: str, duration_s: float) -> None:
        """One Encode call ended with status ``code_name`` (e.g. ``"OK"``)."""
