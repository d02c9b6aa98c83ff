"""``epd up`` really starts the cluster as processes and stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
from cluster_support import free_ports
from oracle_support import make_image, user_message


def _wait_for_line(process: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            if process.poll() is not None:
                break
            continue
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not seen; output:\n{''.join(lines)}")


def test_epd_up_serves_two_images_and_stops_cleanly(tmp_path):
    proxy_port, encoder_port, pd_port, proxy_metrics = free_ports(4)
    env = {**os.environ, "EPD_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--port",
        str(proxy_port),
        "--encoder-base-port",
        str(encoder_port),
        "--pd-base-port",
        str(pd_port),
        "--proxy-metrics-port",
        str(proxy_metrics),
        "--threads",
        "1",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        lines = _wait_for_line(process, "cluster ready", timeout=240)
        assert any("model" in line for line in lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model,
            max_tokens=12,
            messages=[user_message("Compare the two images.", [make_image(1), make_image(2)])],
        )
        assert reply.choices[0].message.content
        assert reply.usage.completion_tokens > 0
        # The proxy's metrics are on its scrape port (loopback), not on its public one.
        assert httpx.get(f"http://127.0.0.1:{proxy_port}/metrics", timeout=10).status_code == 404
        scrape = httpx.get(f"http://127.0.0.1:{proxy_metrics}/metrics", timeout=10)
        assert scrape.status_code == 200 and "epd_proxy_requests_total" in scrape.text
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        output = process.stdout.read()
        assert "stopped" in output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
