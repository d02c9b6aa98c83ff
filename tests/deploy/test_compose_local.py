"""The compose services' own commands, environments and health checks, run as local processes.

There is no Docker engine here, so this runs what each container would run,
in the order ``depends_on`` gives, and rewrites only what one host needs:
service DNS names -> 127.0.0.1, container ports -> free ports, the image's
model directory, /models and /run/secrets -> temporary directories (the
secret: a fresh token), ``--host 0.0.0.0`` -> 127.0.0.1, and the image's
ENTRYPOINT ``epd`` -> ``python -m services.cli``. The image's own
``epd make-model`` step runs first, as the image build does. Then a chat
completion with an image goes through the proxy; the encoder and then PD are
SIGKILLed and started again with nothing but their own command (what a
restart policy does), and requests succeed again; SIGTERM stops every server
with exit code 0 within its compose stop_grace_period."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from cluster_support import free_ports
from deploy_support import (
    EPD_COMPOSE_FILE,
    REPO,
    duration_s,
    flag,
    image_model_build,
    image_model_step,
    load_compose,
    with_defaults,
)
from oracle_support import data_url, make_image

START_TIMEOUT_S = 120.0
"""Upper bound for one service to become healthy (normally a few seconds)."""


def _epd() -> list[str]:
    return [sys.executable, "-m", "services.cli"]


def _health_command() -> list[str]:
    from services.cli import COMMANDS

    # `epd health` until the subcommand is registered, the module itself after.
    return [*_epd(), "health"] if "health" in COMMANDS else [sys.executable, "-m", "services.common.healthcheck"]


@dataclass
class SingleHost:
    """Rewrites compose commands and environments for processes sharing one host."""

    service_names: set[str]
    models_dir: Path  # stands for /models and for the image's model directory
    image_models_dir: str = "/opt/epd/models"
    port_map: dict[int, int] = field(default_factory=dict)
    secrets_dir: Path | None = None  # where /run/secrets/<name> lives on this host

    def map_ports(self, services: dict) -> None:
        """Gives every container port of every service its own free host port."""
        ports = set()
        for service in services.values():
            command = [str(t) for t in service.get("command", [])]
            ports |= {int(command[i + 1]) for i, t in enumerate(command[:-1]) if t in ("--port", "--metrics-port")}
        self.port_map = dict(zip(sorted(ports), free_ports(len(ports))))

    def text(self, value: str) -> str:
        value = with_defaults(str(value)).replace("0.0.0.0", "127.0.0.1")
        value = re.sub(rf"(?<![\w.-]){re.escape(self.image_models_dir)}(?=/|\s|$)", str(self.models_dir), value)
        value = re.sub(r"(?<![\w.-])/models(?=/|\s|$)", str(self.models_dir), value)
        if self.secrets_dir is not None:
            value = re.sub(r"(?<![\w.-])/run/secrets(?=/)", str(self.secrets_dir), value)

        def address(match: re.Match) -> str:
            host, port = match.group(1), int(match.group(2))
            if host in self.service_names | {"127.0.0.1", "localhost"} and port in self.port_map:
                return f"127.0.0.1:{self.port_map[port]}"
            return match.group(0)

        return re.sub(r"(?<![\w.-])([A-Za-z0-9][\w.-]*):(\d+)\b", address, value)

    def argv(self, argv: list) -> list[str]:
        out = []
        for i, token in enumerate(str(t) for t in argv):
            if i and str(argv[i - 1]) in ("--port", "--metrics-port"):
                token = str(self.port_map[int(token)])
            out.append(self.text(token))
        return out

    def shell(self, script: str) -> str:
        epd = " ".join(shlex.quote(part) for part in _epd())
        return re.sub(r"(?<![\w/.-])epd(?=\s)", lambda _: epd, self.text(script))

    def container_command(self, service: dict) -> list[str]:
        """What the container runs: ENTRYPOINT ["epd"] + command, or its own entrypoint."""
        entrypoint = service.get("entrypoint")
        command = service.get("command", [])
        if entrypoint is None:
            return [*_epd(), *self.argv(command)]
        assert entrypoint == ["/bin/sh", "-c"], f"unsupported entrypoint {entrypoint}"
        return ["/bin/sh", "-c", self.shell(command[0])]

    def healthcheck(self, test: list[str]) -> list[str]:
        assert test[:3] == ["CMD", "epd", "health"], f"unsupported health check {test}"
        return [*_health_command(), *self.argv(test[3:])]

    def environment(self, service: dict, cache_dir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}  # only the compose env counts
        env.update({k: self.text(v) for k, v in (service.get("environment") or {}).items()})
        env.update(PYTHONUNBUFFERED="1", EPD_CACHE_DIR=str(cache_dir))
        return env


@dataclass
class Running:
    name: str
    process: subprocess.Popen
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _start(host: SingleHost, name: str, service: dict, tmp: Path) -> Running:
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            host.container_command(service),
            env=host.environment(service, tmp / "cache"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
        )
    return Running(name, process, log)


def _wait_healthy(host: SingleHost, running: Running, healthcheck: dict, env: dict) -> None:
    """Runs the compose health check until it passes, as ``condition: service_healthy`` waits."""
    command = host.healthcheck(healthcheck["test"])
    timeout = duration_s(healthcheck["timeout"])
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert running.process.poll() is None, f"{running.name} exited:\n{running.tail()}"
        try:
            if subprocess.run(command, env=env, cwd=REPO, capture_output=True, timeout=timeout + 10).returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)  # each check is a new Python process: do not starve the start-up
    raise AssertionError(f"{running.name} not healthy after {START_TIMEOUT_S:.0f}s:\n{running.tail()}")


def _run_one_shot(host: SingleHost, name: str, service: dict, tmp: Path) -> None:
    running = _start(host, name, service, tmp)
    try:
        code = running.process.wait(timeout=START_TIMEOUT_S)
    finally:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait(timeout=10)
    assert code == 0, f"{name} failed:\n{running.tail()}"


def _start_waves(services: dict, wanted: list[str]) -> list[list[str]]:
    """Groups services so each group's ``depends_on`` lie in earlier groups."""
    waves, placed = [], set()
    while len(placed) < len(wanted):
        wave = [n for n in wanted if n not in placed and set(services[n].get("depends_on") or {}) <= placed]
        assert wave, "depends_on cycle"
        waves.append(wave)
        placed |= set(wave)
    return waves


def _chat_with_image(base_url: str, attempts: int = 1) -> None:
    """One chat completion with an image; ``attempts`` > 1 retries 502/503/504 once a second (the proxy
    re-resolves and re-probes a restarted backend on its own schedule)."""
    body = {
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": data_url(make_image(seed=3, size=(40, 32)))}},
                ],
            }
        ],
    }
    with httpx.Client(base_url=base_url, timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for _ in range(attempts):
            reply = client.post("/v1/chat/completions", json={"model": model, **body})
            if reply.status_code not in (502, 503, 504):
                break
            time.sleep(1.0)
    assert reply.status_code == 200, reply.text[:500]
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] in ("length", "stop")


def _stop(running: list[Running], services: dict) -> None:
    """SIGTERM in ``docker compose stop`` order (dependents first); each must exit 0 within its grace."""
    codes, logs = {}, {}
    for item in running:
        item.process.send_signal(signal.SIGTERM)
        try:
            codes[item.name] = item.process.wait(timeout=duration_s(services[item.name]["stop_grace_period"]))
        except subprocess.TimeoutExpired:
            item.process.kill()
            codes[item.name] = "outlived its stop_grace_period"
        if codes[item.name] != 0:
            logs[item.name] = item.tail()
    # 0 is what a clean drain reports to `docker compose stop` and to Kubernetes.
    # (uvicorn re-raises the stopping signal after its shutdown, so a process
    # without its own SIGTERM handler ends with -15 even after draining.)
    details = "".join(f"\n--- {name} log tail:\n{tail}" for name, tail in logs.items())
    assert codes == {item.name: 0 for item in running}, f"exit codes on SIGTERM: {codes}{details}"


def _restart_after_sigkill(host: SingleHost, item: Running, services: dict, tmp: Path) -> Running:
    """SIGKILL, then the same command again and nothing else (what ``restart: unless-stopped`` does)."""
    item.process.kill()
    item.process.wait(timeout=10)
    restarted = _start(host, item.name, services[item.name], tmp)
    env = host.environment(services[item.name], tmp / "cache")
    _wait_healthy(host, restarted, services[item.name]["healthcheck"], env)
    return restarted


def _single_host(services: dict, tmp_path: Path) -> SingleHost:
    """One host for ``services``: free ports, a fresh token as the secret, and the image's model built."""
    host = SingleHost(service_names=set(services), models_dir=tmp_path / "models", secrets_dir=tmp_path / "secrets")
    host.models_dir.mkdir()
    host.secrets_dir.mkdir()
    for name in load_compose()["secrets"]:  # what `docker compose` would mount from each secret's file
        (host.secrets_dir / name).write_text(secrets.token_urlsafe(32))
    host.map_ports(services)
    # What the image build does (deploy/Dockerfile); no compose service builds a model.
    _, image_model_dir = image_model_build()
    host.image_models_dir = image_model_dir.rsplit("/", 1)[0]
    step = {"entrypoint": ["/bin/sh", "-c"], "command": [image_model_step()]}
    _run_one_shot(host, "image-model", step, tmp_path)
    files = [p for p in (host.models_dir / image_model_dir.rsplit("/", 1)[1]).rglob("*") if p.is_file()]
    assert "config.json" in {p.name for p in files} and "model.safetensors" in {p.name for p in files}
    # Root builds it, uid 10001 serves it: every file must be readable by others.
    assert [p.name for p in files if not p.stat().st_mode & 0o004] == []
    return host


def _start_in_order(host: SingleHost, services: dict, wanted: list[str], tmp_path: Path, running: dict) -> None:
    """Starts ``wanted`` wave by wave into ``running``, each wave healthy before the next starts."""
    for wave in _start_waves(services, wanted):
        servers = [_start(host, name, services[name], tmp_path) for name in wave]
        running.update((server.name, server) for server in servers)
        for server in servers:
            env = host.environment(services[server.name], tmp_path / "cache")
            _wait_healthy(host, server, services[server.name]["healthcheck"], env)


def _kill_all(running: dict) -> None:
    for item in running.values():
        if item.process.poll() is None:
            item.process.kill()
            item.process.wait(timeout=10)


def _scrape(host: SingleHost, service: dict) -> str:
    port = host.port_map[int(flag(service["command"], "--metrics-port"))]
    token = (host.secrets_dir / "epd_internal_token").read_text()
    reply = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert reply.status_code == 200
    return reply.text


def _sample(text: str, name: str, role: str) -> float:
    (value,) = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(f'{name}{{role="{role}"}} ')]
    return value


def _plain_sample(text: str, name: str) -> float:
    (value,) = [float(line.split()[1]) for line in text.splitlines() if line.startswith(f"{name} ")]
    return value


def test_compose_services_run_as_local_processes(tmp_path):
    services = load_compose()["services"]
    wanted = ["pd", "encoder", "proxy"]
    host = _single_host(services, tmp_path)
    running: dict[str, Running] = {}
    try:
        _start_in_order(host, services, wanted, tmp_path, running)

        proxy_port = host.port_map[int(flag(services["proxy"]["command"], "--port"))]
        _chat_with_image(f"http://127.0.0.1:{proxy_port}")
        encoder_metrics = host.port_map[int(flag(services["encoder"]["command"], "--metrics-port"))]
        proxy_metrics = host.port_map[int(flag(services["proxy"]["command"], "--metrics-port"))]
        token = (host.secrets_dir / "epd_internal_token").read_text()
        public = f"http://127.0.0.1:{proxy_port}/metrics"  # the token opens nothing on the public port
        assert httpx.get(public, headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code == 404
        for port in (encoder_metrics, proxy_metrics):  # scrapes need the internal token
            url = f"http://127.0.0.1:{port}/metrics"
            assert httpx.get(url, timeout=10).status_code == 401
            assert httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code == 200

        for name in ("encoder", "pd"):
            running[name] = _restart_after_sigkill(host, running[name], services, tmp_path)
            _chat_with_image(f"http://127.0.0.1:{proxy_port}", attempts=20)
        _stop([running[name] for name in reversed(wanted)], services)
    finally:
        _kill_all(running)


def test_compose_epd_override_serves_through_prefill_and_decode(tmp_path):
    """docker-compose.epd.yml merged in: the request goes encoder -> pd (prefill) -> decode, and the KV
    hand-off shows in both PDs' metrics, each under its own role."""
    services = load_compose(EPD_COMPOSE_FILE)["services"]
    wanted = ["pd", "decode", "encoder", "proxy"]
    host = _single_host(services, tmp_path)
    running: dict[str, Running] = {}
    try:
        _start_in_order(host, services, wanted, tmp_path, running)
        proxy_port = host.port_map[int(flag(services["proxy"]["command"], "--port"))]
        _chat_with_image(f"http://127.0.0.1:{proxy_port}")

        prefill, decode = _scrape(host, services["pd"]), _scrape(host, services["decode"])
        assert _sample(prefill, "epd_pd_kv_pushes_total", "prefill") == 1
        assert _sample(decode, "epd_pd_kv_pushes_total", "decode") == 1
        assert _sample(prefill, "epd_pd_kv_push_bytes_total", "prefill") > 0
        assert _sample(decode, "epd_pd_kv_push_bytes_total", "decode") > 0
        # The first token came from the prefill PD; the decode PD generated the rest.
        assert _plain_sample(decode, "epd_pd_generation_tokens_total") >= 1
        _stop([running[name] for name in reversed(wanted)], services)
    finally:
        _kill_all(running)
