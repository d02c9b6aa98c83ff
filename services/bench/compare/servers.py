"""The servers ``epd bench compare`` measures: ``epd up`` in one of its modes, or a peer at a URL.

A peer is any OpenAI-compatible server (vLLM, SGLang, ...). Given a start
command it is started before each of its runs and stopped after, so that
every server runs alone on the machine; without one it must already be
running at its URL (and then it sits idle beside the others' runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

EPD_MODES = {
    "up": (),
    "colocated": ("--colocated",),
    "epd": ("--prefills", "1", "--decodes", "1"),
}
"""``epd up`` modes by name: E+PD (the default), one PD that also encodes, and E+P+D."""


@dataclass(frozen=True)
class Target:
    """One server to measure: an ``epd up`` mode (``up_args``) or a peer (``url``, optionally ``start``)."""

    name: str
    up_args: tuple[str, ...] | None = None
    url: str = ""
    start: str = ""  # shell command; {model} and {port} are replaced

    @property
    def is_peer(self) -> bool:
        return self.up_args is None

    @property
    def label(self) -> str:
        if self.up_args is not None:
            return " ".join(["epd up", *self.up_args])
        return f"{self.name} ({self.url})"


def model_id(base_url: str, timeout_s: float = 5.0) -> str:
    """The first model a server lists at ``/v1/models``."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout_s) as reply:
        return str(json.loads(reply.read())["data"][0]["id"])


def _answers(base_url: str) -> bool:
    """Ready means serving: it lists a model and completes a one-token request (a server may list its
    model before its backends are up, or compile on its first request)."""
    try:
        model = model_id(base_url, timeout_s=2.0)
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        request = urllib.request.Request(
            f"{base_url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600.0) as reply:
            return reply.status == 200
    except (OSError, ValueError, KeyError, IndexError, urllib.error.URLError):
        return False


@contextlib.contextmanager
def serving(target: Target, model_dir: str, *, ready_timeout_s: float, log_dir: Path) -> Iterator[str]:
    """Starts ``target`` (unless it is a peer without a start command), yields its base URL once it answers,
    and stops what it started."""
    if not target.is_peer:
        from services.bench.serve.procs import epd_up

        with epd_up(model_dir, target.up_args or ()) as base_url:
            yield base_url
        return
    base_url = target.url.rstrip("/")
    if not target.start:
        if not _answers(base_url):
            raise RuntimeError(f"peer {target.name} does not answer at {base_url}/v1/models")
        yield base_url
        return
    port = urllib.parse.urlsplit(base_url).port or 80
    command = target.start.replace("{model}", model_dir).replace("{port}", str(port))
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{target.name}.log", "ab") as log:
        child = subprocess.Popen(command, shell=True, stdout=log, stderr=log, start_new_session=True)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while not _answers(base_url):
                if child.poll() is not None:
                    raise RuntimeError(f"peer {target.name} exited with code {child.returncode} before it answered")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"peer {target.name} did not answer within {ready_timeout_s:.0f} s")
                time.sleep(1.0)
            yield base_url
        finally:
            _stop_group(child)


def _stop_group(child: subprocess.Popen) -> None:
    """SIGINT, then SIGTERM, then SIGKILL to the child's whole process group."""
    for sig, wait_s in ((signal.SIGINT, 30.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if child.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=wait_s)
    # The group may outlive its leader (a server's worker processes): make sure nothing is left.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)


def say(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)
