"""``epd bench serve`` process handling: pinning, readiness failures, bounded stop, and a failed configuration."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.bench.serve import procs
from services.bench.serve.layout import LayoutConfig, build_topologies
from services.bench.serve.output import build_results, write_outputs
from services.bench.serve.procs import Cluster, ServiceArgs, proxy_ready
from services.bench.serve.runner import Runner, RunPlan

CORE = min(os.sched_getaffinity(0))


def cluster_running(tmp_path, script: str) -> Cluster:
    """A one-core colocated cluster whose processes run ``script`` instead of the services."""
    topology = build_topologies(LayoutConfig(cores=(CORE,)), ("colocated",))["colocated"]
    cluster = Cluster(topology, ServiceArgs(model_dir="unused"), tmp_path)
    cluster.command = [sys.executable, "-c", script]
    return cluster


def test_a_process_that_exits_during_start_up_is_reported(tmp_path):
    cluster = cluster_running(tmp_path, "import sys; sys.exit(3)")
    cluster.start()
    try:
        with pytest.raises(RuntimeError, match="exited with code 3 during start-up"):
            asyncio.run(cluster.wait_ready(30))
    finally:
        codes = cluster.stop(grace_s=5)
    assert 3 in codes.values() and None not in codes.values()  # the other may have been stopped first


def test_start_up_timeout_then_bounded_stop_kills_what_ignores_sigterm(tmp_path):
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    cluster = cluster_running(tmp_path, script)
    cluster.start()
    try:
        assert [c.measured_cores for c in cluster.children] == [(CORE,), (CORE,)]  # pinned before exec
        with pytest.raises(TimeoutError, match="not ready after"):
            asyncio.run(cluster.wait_ready(0.5))
    finally:
        codes = cluster.stop(grace_s=0.5)
    assert set(codes.values()) == {-9}  # SIGTERM ignored, so killed after the grace period
    assert cluster.exited() == ["pd-0", "proxy-0"]


HEALTH_REPLIES = {
    "/ready/health": (200, {"status": "ok", "pd": {"a": True}, "encoder": {"b": True}}),
    "/partial/health": (200, {"status": "ok", "pd": {"a": True, "c": False}, "encoder": {"b": True}}),
    "/down/health": (503, {"status": "unavailable"}),
    "/epd/health": (200, {"status": "ok", "pd": {"a": True}, "encoder": {"b": True}, "decode": {"c": True}}),
    "/nodecode/health": (200, {"status": "ok", "pd": {"a": True}, "encoder": {"b": True}, "decode": {"c": False}}),
}


class FakeHealthHandler(BaseHTTPRequestHandler):
    """Answers ``HEALTH_REPLIES[path]`` like the proxy's /health."""

    def do_GET(self):  # http.server's name
        status, body = HEALTH_REPLIES[self.path]
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHealthHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_proxy_ready_needs_every_backend_ready(health_server):
    assert proxy_ready(f"{health_server}/ready")
    assert not proxy_ready(f"{health_server}/partial")
    assert not proxy_ready(f"{health_server}/down")
    assert not proxy_ready("http://127.0.0.1:1")
    # E+P+D: the decode PDs must be ready too.
    assert proxy_ready(f"{health_server}/epd")
    assert not proxy_ready(f"{health_server}/nodecode")


def test_a_configuration_that_fails_is_reported_and_the_others_still_run(tmp_path):
    topologies = build_topologies(LayoutConfig(cores=(CORE,)), ("colocated", "replicas"))
    plan = RunPlan(
        workload="text",
        num_requests=2,
        max_tokens=4,
        prompt_words=4,
        seed=0,
        image_size=32,
        rates=(1.0,),
        slo_ttft_ms=100.0,
        slo_tpot_ms=10.0,
        progress=False,
        startup_timeout_s=30,
    )
    attempted = []

    def failing_cluster(topology, service, log_dir):
        attempted.append(topology.name)
        cluster = Cluster(topology, service, log_dir)
        cluster.command = [sys.executable, "-c", "import sys; sys.exit(4)"]
        return cluster

    runner = Runner(plan, topologies, ServiceArgs(model_dir="unused"), tmp_path / "logs", failing_cluster)
    runner.run()
    assert attempted == ["colocated", "replicas"]
    assert all("exited with code 4" in result.error for result in runner.results.values())
    context = {
        "command": "test",
        "machine": {"cpu": "x", "num_cpus": 1, "cores": [CORE], "platform": "p", "torch": "t"},
        "load_average": {},
        "model": {"path": "m", "image_size": 32},
        "service_args": {},
        "plan": {},
    }
    results = build_results(runner, context)
    assert results["configs"]["colocated"]["error"] and results["analysis"]["target_rate"] is None
    write_outputs(tmp_path, runner, context, plots=False)
    assert "**failed**" in (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["slo"]["ttft_ms"] == 100.0


READY_PROXY = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Ready(BaseHTTPRequestHandler):
    def do_GET(self):
        data = json.dumps({"status": "ok", "pd": {"a": True}, "encoder": {"b": True}}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
"""
REFUSED = "import sys; print('epd: port 1 (--port) is taken', file=sys.stderr); sys.exit(2)"


@pytest.fixture
def up_commands(monkeypatch):
    """``epd_up`` runs these scripts in turn (test doubles of ``epd up``), each on a fresh port."""
    scripts: list[str] = []

    def argv(model_dir, up_args):
        port = procs.free_port()
        return [sys.executable, "-c", scripts.pop(0), str(port)], f"http://127.0.0.1:{port}"

    monkeypatch.setattr(procs, "_up_argv", argv)
    return scripts


def test_epd_up_tries_a_start_refused_for_its_ports_again(up_commands):
    up_commands += [REFUSED, READY_PROXY]
    with procs.epd_up("unused") as base_url:
        assert proxy_ready(base_url)
    assert up_commands == []


def test_epd_up_gives_up_after_its_tries_with_the_last_line_of_stderr(up_commands):
    up_commands += [REFUSED] * procs.START_TRIES
    refused = r"refused to start 3 times: epd: port 1 \(--port\) is taken"
    with pytest.raises(RuntimeError, match=refused), procs.epd_up("unused"):
        pass


def test_epd_up_reports_a_child_that_fails_otherwise_at_once(up_commands):
    up_commands += ["import sys; print('epd: model not found', file=sys.stderr); sys.exit(1)", READY_PROXY]
    failed = "exited with code 1 before it was ready: epd: model not found"
    with pytest.raises(RuntimeError, match=failed), procs.epd_up("unused"):
        pass
    assert up_commands == [READY_PROXY]
