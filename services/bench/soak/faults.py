"""Process faults of ``epd bench soak``: SIGKILL or SIGTERM one process, restart it, time the recovery.

Times are measured from outside, the way a user sees them:

- ``recovered_s``: from the signal until a fresh probe request (one new
  image, so it needs an encoder and a PD) succeeds through the proxy;
- ``rejoined_s``: from the restart until the proxy's ``/health`` reports the
  restarted instance ready again (it then takes traffic).
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from services.bench.serve.procs import Child, Cluster

PROBE_TIMEOUT_S = 20.0


@dataclass
class FaultResult:
    """One injected process fault and how the cluster came through it."""

    fault: str  # "SIGKILL encoder-1", "SIGTERM pd-0", ...
    exit_code: int | None  # of the signalled process (-9 for SIGKILL; 0 is a clean drain)
    recovered_s: float | None
    rejoined_s: float | None
    probes_failed: int  # probe requests that failed before the first success

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_body(image_size: int) -> bytes:
    """A short chat request with one new random image (never cached: it needs a live encoder and PD)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.frombytes("RGB", (image_size, image_size), os.urandom(image_size * image_size * 3)).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}}]
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2}).encode()


def probe(base_url: str, image_size: int) -> bool:
    """One non-streaming request through the proxy; True on 200."""
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions", data=probe_body(image_size), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as reply:
            return reply.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def instance_ready(base_url: str, kind: str, address: str) -> bool:
    """The proxy's ``/health`` lists ``address`` among its ready ``kind`` instances."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as reply:
            report = json.loads(reply.read())
    except urllib.error.HTTPError as error:  # 503 still carries the report
        report = json.loads(error.read() or b"{}")
    except (OSError, ValueError):
        return False
    return bool(report.get(kind, {}).get(address))


def _until(predicate, timeout_s: float, interval_s: float = 0.1) -> tuple[float | None, int]:
    """Seconds until ``predicate()`` held (None = never within ``timeout_s``) and how often it did not."""
    start = time.monotonic()
    misses = 0
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start, misses
        misses += 1
        time.sleep(interval_s)
    return None, misses


def inject(
    cluster: Cluster,
    child: Child,
    sig: signal.Signals,
    *,
    base_url: str,
    image_size: int,
    ready_timeout_s: float,
    grace_s: float,
) -> FaultResult:
    """Signals ``child``, waits for it to exit and for the cluster to serve again, restarts it, waits for rejoin."""
    import asyncio

    assert child.process is not None
    started = time.monotonic()
    child.process.send_signal(sig)
    recovered, misses = _until(lambda: probe(base_url, image_size), ready_timeout_s)
    try:
        exit_code = child.process.wait(timeout=max(1.0, grace_s + 10.0 - (time.monotonic() - started)))
    except Exception:
        child.process.kill()
        exit_code = child.process.wait()
    if recovered is not None:
        recovered = round(recovered, 3)
    cluster.start_child(child)
    restarted = time.monotonic()
    asyncio.run(cluster.wait_ready(ready_timeout_s, [child]))
    rejoined, _ = _until(lambda: instance_ready(base_url, child.spec.role, child.address), ready_timeout_s)
    if rejoined is not None:
        rejoined = round(time.monotonic() - restarted, 3)
    return FaultResult(f"{sig.name} {child.spec.name}", exit_code, recovered, rejoined, misses)
