"""A child's output, drained continuously: forwarded to ``epd up``'s own output and its last lines kept.

Split from ``supervisor.py``: this is the part that must never
block, whatever the process on the other end of ``epd up``'s output does.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from typing import IO

TAIL_LINES = 20
"""Output lines kept per child for the crash report."""
MAX_LINE_CHARS = 500
"""A kept line longer than this is cut (forwarding is unchanged)."""
MAX_PENDING_LINES = 10_000
"""Children's output lines waiting for ``epd up``'s own output; beyond this they are dropped, never waited for."""


class OutputForwarder:
    """Writes the children's output lines to ``sink`` on a thread of its own; never blocks a reader.

    ``epd up``'s own output may be a pipe that nobody reads (``epd up | head``,
    a parent that stopped reading): a write there blocks for good. The pumps
    that drain the children's pipes therefore only queue lines here; when
    ``max_pending_lines`` are waiting, further lines are dropped and counted
    (``num_dropped``; a note says how many once the sink takes writes again),
    so a child never blocks on its own stdout and the cluster keeps serving.
    """

    def __init__(self, sink: IO[bytes], max_pending_lines: int = MAX_PENDING_LINES) -> None:
        self.num_dropped = 0
        self._sink = sink
        try:
            # Written with os.write, not through ``sink``'s buffer: a write blocked on a full pipe then
            # holds no lock of the interpreter's, and ``epd up`` can still exit cleanly.
            self._fd: int | None = sink.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
            self._fd = None
        self._pending: queue.Queue[bytes] = queue.Queue(max_pending_lines)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._write, daemon=True, name="child-output-writer")
        self._thread.start()

    def put(self, raw: bytes) -> None:
        """Queues one line for the sink, or drops it when the sink is not keeping up (never waits)."""
        try:
            self._pending.put_nowait(raw)
        except queue.Full:
            with self._lock:
                self.num_dropped += 1

    def _write(self) -> None:
        reported = 0
        while True:
            raw = self._pending.get()
            try:
                with self._lock:
                    dropped = self.num_dropped
                if dropped > reported:
                    note = f"epd: {dropped - reported} lines of the services' output were dropped (nobody read them)\n"
                    self._emit(note.encode())
                    reported = dropped
                self._emit(raw)
            except (OSError, ValueError):
                pass  # our own output is gone; the pumps keep draining regardless
            finally:
                self._pending.task_done()

    def _emit(self, data: bytes) -> None:
        if self._fd is None:
            self._sink.write(data)
            self._sink.flush()
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def flush(self, wait_s: float = 1.0) -> None:
        """Waits up to ``wait_s`` for the queued lines to reach the sink."""
        end = time.monotonic() + wait_s
        while self._pending.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)


class OutputTail:
    """Drains a child's output continuously: each line goes to ``forwarder`` and its last lines are kept."""

    def __init__(self, stream: IO[bytes], forwarder: OutputForwarder, num_lines: int = TAIL_LINES) -> None:
        self._lines: deque[str] = deque(maxlen=num_lines)
        self._lock = threading.Lock()
        self._forwarder = forwarder
        self._thread = threading.Thread(target=self._pump, args=(stream, forwarder), daemon=True, name="child-output")
        self._thread.start()

    def _pump(self, stream: IO[bytes], forwarder: OutputForwarder) -> None:
        with stream:
            for raw in iter(lambda: stream.readline(65536), b""):
                forwarder.put(raw)
                with self._lock:
                    self._lines.append(raw.decode("utf-8", "replace").rstrip()[:MAX_LINE_CHARS])

    def lines(self, wait_s: float = 1.0) -> list[str]:
        """The last lines (after up to ``wait_s`` for the pipe to drain and reach the sink, when the child has exited)."""
        self._thread.join(wait_s)
        self._forwarder.flush(wait_s)
        with self._lock:
            return list(self._lines)
