"""At most a few image requests per PD between their Preallocate and their first token (``ImageWindows``).

On one host the encoder and the PD share the cores, and the PD holds its
steps while an image it reserved room for is still to come
(``services/pd/shared_cores.py``): whatever is computed, is computed one
after the other. In what order then decides the first tokens. Given a burst
of sixteen image requests at once, an encoder works through all sixteen
images before the PD prefills any of their prompts, so the median request's
first token comes after nearly the whole burst's encoding and half its
prefills. Letting only a few image requests per PD start (Preallocate, then
Encode) until their prompts are prefilled takes the work in turns: a few
images, their prompts, the next few, as an engine that encodes only for the
prompt it is about to prefill does. The others wait here, in arrival order;
a request enters as soon as one ahead of it has its first token or ends.
Text-only requests never wait: they need no encoder.

A window of 0 lets every request start at once, for encoders that run on
other machines than their PDs: there the encoder may run ahead of PD's
prefills, and should.
"""

from __future__ import annotations

import asyncio

DEFAULT_IMAGE_WINDOW = 2
"""Image requests per PD let start at once by default. In an image burst through ``epd up`` on 2 CPU
cores (bench checkpoint, two runs each) 2 gave the earliest first tokens: TTFT p50 0.63x that of no bound
and 1.09x the tok/s on one host, 0.79x and 0.95x on a host twice as fast; 1 and 4 came between
(docs/benchmarks/compare.md)."""


class _Window:
    """One PD's window: its places (``asyncio.Semaphore``: first come, first served; a place handed to a
    waiter cancelled meanwhile goes on to the next), and the requests inside it or waiting for it."""

    def __init__(self, size: int) -> None:
        self.places = asyncio.Semaphore(size)
        self.inside = 0
        self.users = 0  # inside or waiting


class ImageWindows:
    """Per PD address, at most ``size`` image requests between their Preallocate and their first token
    (0 = no bound)."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError("the image window must be >= 0 (0 = no bound)")
        self.size = size
        self._windows: dict[str, _Window] = {}

    async def enter(self, address: str) -> None:
        """Returns once a request to ``address`` may start; every ``enter`` that returns needs one ``leave``.
        Cancelled while waiting, it holds no place (one passed to it meanwhile goes to the next)."""
        if self.size <= 0:
            return
        window = self._windows.setdefault(address, _Window(self.size))
        window.users += 1
        try:
            await window.places.acquire()
        except BaseException:
            self._done_with(address, window)
            raise
        window.inside += 1

    def leave(self, address: str) -> None:
        """Gives the place of one request that entered to the next one waiting, if any."""
        if self.size <= 0:
            return
        window = self._windows[address]
        window.inside -= 1
        window.places.release()
        self._done_with(address, window)

    def _done_with(self, address: str, window: _Window) -> None:
        window.users -= 1
        if window.users == 0:
            del self._windows[address]  # PDs come and go (DNS): keep no entry for one with nothing in it

    def num_inside(self, address: str) -> int:
        """Requests in ``address``'s window now."""
        window = self._windows.get(address)
        return window.inside if window else 0

    def num_waiting(self) -> int:
        """Requests waiting to enter, over every PD."""
        return sum(window.users - window.inside for window in self._windows.values())
