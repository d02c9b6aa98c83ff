"""``epd up`` really starts the cluster as processes and stops it cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
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


def test_ctrl_c_stops_an_idle_cluster_and_leaves_no_child(tiny_model_dir, tmp_path):
    """SIGINT on an idle cluster: ``epd up`` stops it (proxy, encoder, PD: the order is
    ``test_stopping_goes_tier_by_tier_and_each_tier_stops_together``), exits 0 and no child outlives it.
    How long it took is printed: it was 14-21 s on a 2-core machine, each child stopping at once but taking
    seconds to tear its interpreter down, one after another."""
    ports = free_ports(7)
    flags = ["--port", "--encoder-base-port", "--pd-base-port", "--encoder-metrics-base-port"]
    flags += ["--pd-metrics-base-port", "--launcher-metrics-port", "--proxy-metrics-port"]
    command = [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model_dir), "--threads", "1"]
    command += [part for flag, port in zip(flags, ports) for part in (flag, str(port))]
    env = {**os.environ, "EPD_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        lines = _wait_for_line(process, "cluster ready", timeout=240)
        ready = {}
        for line in lines:  # one line per service as it becomes ready: its address, how long it took, its pid
            match = re.match(r"epd: (\S+) ready on (\S+) \((\d+\.\d) s, pid (\d+)\)$", line.strip())
            if match:
                ready[match.group(1)] = int(match.group(4))
        assert sorted(ready) == ["encoder-0", "pd-0", "proxy"], lines
        assert re.search(r"epd: cluster ready in \d+\.\d s\. OpenAI API at http://127\.0\.0\.1:\d+/v1", lines[-1])
        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
        print(f"idle cluster stopped {time.monotonic() - started:.1f} s after SIGINT")
        for pid in ready.values():
            with pytest.raises(ProcessLookupError):  # gone and reaped by epd up, not left behind
                os.kill(pid, 0)
        output = process.stdout.read()
        assert output.rstrip().endswith("epd: stopped")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
