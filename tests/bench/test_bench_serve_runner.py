"""``epd bench serve`` measuring loop against a fake proxy: automatic sweep, calibration, and each failure branch.

No model processes: a ``FakeClusterDouble`` stands for a started cluster and
points the runner at ``FakeStreamingProxy``, a threaded HTTP server that
streams OpenAI chunks (or fails) as its policy says.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.bench.serve.layout import LayoutConfig, build_topologies
from services.bench.serve.procs import ServiceArgs
from services.bench.serve.runner import Runner, RunPlan


class FakeStreamingProxy:
    """``/v1/chat/completions`` that streams ``max_tokens`` tokens, or answers 500 when ``fail(n)`` says so."""

    def __init__(self, fail=lambda n: False) -> None:
        self.fail = fail
        self.num_requests = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # http.server's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with proxy._lock:
                    number = proxy.num_requests
                    proxy.num_requests += 1
                if proxy.fail(number):
                    self.send_response(500)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for token in range(body["max_tokens"]):
                    time.sleep(0.002)
                    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [token]}]}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": body["max_tokens"]}}
                self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeStreamingProxy:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeClusterDouble:
    """Stands for a started cluster whose proxy is ``url``; ``dead`` names processes that 'exited'."""

    def __init__(self, url: str, dead: tuple[str, ...] = ()) -> None:
        self.proxy_urls = [url]
        self.dead = list(dead)
        self.stopped = False

    def start(self) -> None:
        pass

    async def wait_ready(self, timeout_s: float) -> None:
        pass

    def describe(self) -> list[dict]:
        return [{"name": "pd-0", "cores": [0]}]

    def exited(self) -> list[str]:
        return self.dead

    def stop(self, grace_s: float = 15.0) -> dict:
        self.stopped = True
        return {}


def make_runner(tmp_path, proxy, *, rates=(), slo=(0.0, 0.0), dead=(), workload="text", configs=("colocated",)):
    plan = RunPlan(
        workload=workload,
        num_requests=4,
        max_tokens=3,
        prompt_words=3,
        seed=0,
        image_size=16,
        rates=rates,
        rate_multipliers=(0.5, 1.0),
        slo_ttft_ms=slo[0],
        slo_tpot_ms=slo[1],
        calibration_requests=1,
        burst_requests=4,
        progress=False,
    )
    doubles = []

    def factory(topology, service, log_dir):
        doubles.append(FakeClusterDouble(proxy.url, dead))
        return doubles[-1]

    topologies = build_topologies(LayoutConfig(cores=(0, 1)), configs)
    return Runner(plan, topologies, ServiceArgs(model_dir="unused"), tmp_path, factory), doubles


def test_automatic_sweep_calibrates_once_then_measures_every_configuration(tmp_path):
    with FakeStreamingProxy() as proxy:
        runner, doubles = make_runner(tmp_path, proxy, configs=("colocated", "disagg"))
        runner.run()
    assert [r.error for r in runner.results.values()] == [None, None]
    assert all(d.stopped for d in doubles)
    calibration = runner.calibration
    assert calibration["config"] == "colocated" and calibration["burst_capacity_rps"] > 0
    assert calibration["step_ms"] > 0 and calibration["lone_ttft_of"] == "a lone text request"
    capacity = calibration["burst_capacity_rps"]
    assert runner.rates == sorted({float(f"{capacity * m:.3g}") for m in (0.5, 1.0)})
    assert "automatic" in runner.rates_source
    assert runner.slo.tpot_ms == pytest.approx(3 * calibration["step_ms"], abs=0.1)
    assert "Derived on colocated" in runner.slo.derivation
    for result in runner.results.values():
        assert sorted(result.records) == runner.rates
        assert all(r.ok for records in result.records.values() for r in records)
        assert [run["rate"] for run in result.runs] == runner.rates
    # First configuration: warm-up 1 + lone 1 + burst 4 + 4 per rate; the second: warm-up 1 + 4 per rate.
    assert proxy.num_requests == (1 + 1 + 4 + 4 * len(runner.rates)) + (1 + 4 * len(runner.rates))


def test_given_rates_and_slo_skip_calibration(tmp_path):
    with FakeStreamingProxy() as proxy:
        runner, _ = make_runner(tmp_path, proxy, rates=(20.0, 50.0), slo=(100.0, 10.0))
        runner.run()
    assert runner.calibration == {} and runner.rates == [20.0, 50.0]
    assert runner.slo.derivation == "given on the command line"
    assert proxy.num_requests == 1 + 2 * 4


@pytest.mark.parametrize(
    ("fail", "dead", "message"),
    [
        (lambda n: True, (), "warm-up requests failed (text: HTTP 500)"),
        (lambda n: n == 1, (), "calibration requests failed"),
        (lambda n: n >= 2, (), "the capacity burst completed no request"),
        (lambda n: False, ("pd-0",), "process(es) exited during the run: pd-0"),
    ],
)
def test_failures_mark_the_configuration_and_stop_its_cluster(tmp_path, fail, dead, message):
    with FakeStreamingProxy(fail) as proxy:
        runner, doubles = make_runner(tmp_path, proxy, dead=dead)
        runner.run()
    assert message in runner.results["colocated"].error
    assert doubles[0].stopped
