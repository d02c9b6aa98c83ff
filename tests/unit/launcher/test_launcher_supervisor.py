"""``epd up``'s supervision: the restart policy, and the supervisor driving tiny stand-in processes.

The stand-ins are real child processes (``python -c ...``), so exits,
signals and output forwarding are real; only what they run is not an EPD
service (that is ``tests/e2e/test_e2e_up_supervision.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import grpc_utils, launch_proof, security
from services.common.security import InternalSecurity
from services.launcher import command as up
from services.launcher.child_output import OutputForwarder, OutputTail
from services.launcher.policy import CrashHistory, HealthPolicy, RestartPolicy, describe_exit
from services.launcher.spawner import ProcessSpawner
from services.launcher.specs import ServiceSpec
from services.launcher.supervisor import StartupFailed, Supervisor

RUN_FOREVER = "import time\nprint('up', flush=True)\nwhile True: time.sleep(1)"
CRASH = "import sys\nprint('loading ...', flush=True)\nprint('boom: port in use', flush=True)\nsys.exit(3)"


# -- policy -------------------------------------------------------------------
def test_backoff_doubles_within_the_window_and_is_capped():
    history = CrashHistory(RestartPolicy(max_restarts=10, window_s=100, backoff_s=1.0, max_backoff_s=5.0))
    assert [history.on_exit(t) for t in (0, 1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_restarts_older_than_the_window_are_forgotten():
    history = CrashHistory(RestartPolicy(max_restarts=2, window_s=10, backoff_s=1.0))
    assert history.on_exit(0) == 1.0
    assert history.on_exit(5) == 2.0
    assert history.on_exit(9) is None  # a third exit within 10 s: crash loop
    fresh = CrashHistory(RestartPolicy(max_restarts=2, window_s=10, backoff_s=1.0))
    assert fresh.on_exit(0) == 1.0 and fresh.on_exit(5) == 2.0
    assert fresh.on_exit(16) == 1.0  # both earlier restarts left the window


def test_zero_restarts_means_any_exit_stops_the_cluster():
    assert CrashHistory(RestartPolicy(max_restarts=0)).on_exit(0) is None


@pytest.mark.parametrize("kwargs", [{"max_restarts": -1}, {"window_s": 0}, {"backoff_s": 5, "max_backoff_s": 1}])
def test_invalid_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)


def test_exits_are_described_by_code_or_signal():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"


# -- the supervisor with stand-in processes -----------------------------------------
class StandIns:
    """Test double spawner: each spec's argv[0] is a Python script run as the child."""

    def __init__(self) -> None:
        self.sink = io.BytesIO()
        self.forwarder = OutputForwarder(self.sink)
        self.scripts: dict[str, str] = {}
        self.num_spawned: dict[str, int] = {}

    def spawn(self, spec: ServiceSpec):
        script = self.scripts.get(spec.name, spec.argv[0])
        process = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.num_spawned[spec.name] = self.num_spawned.get(spec.name, 0) + 1
        return process, OutputTail(process.stdout, self.forwarder)


async def alive(spec: ServiceSpec, launch_key: str) -> bool:
    return True


def _specs(*scripts: tuple[str, str]) -> list[ServiceSpec]:
    return [ServiceSpec(name, (script,), f"127.0.0.1:{5000 + i}", None) for i, (name, script) in enumerate(scripts)]


async def _until(predicate, what: str, timeout_s: float = 30.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _metric(supervisor: Supervisor, name: str, service: str) -> float:
    return supervisor.metrics.registry.get_sample_value(name, {"service": service})


async def test_a_killed_child_is_restarted_and_the_others_keep_running():
    stand_ins, said = StandIns(), []
    policy = RestartPolicy(max_restarts=3, window_s=60, backoff_s=0.05)
    supervisor = Supervisor(
        _specs(("encoder-0", RUN_FOREVER), ("pd-0", RUN_FOREVER)),
        policy,
        is_ready=alive,
        spawn=stand_ins.spawn,
        say=said.append,
    )
    stop = asyncio.Event()
    try:
        supervisor.start_all()
        await supervisor.wait_ready(30, stop)
        encoder, pd = supervisor.children
        pd_pid, old_pid = pd.pid, encoder.pid
        task = asyncio.create_task(supervisor.supervise(stop))
        os.kill(old_pid, signal.SIGKILL)
        await _until(
            lambda: encoder.pid != old_pid and _metric(supervisor, "epd_launcher_service_up", "encoder-0"),
            "the restarted encoder",
        )
        stop.set()
        assert await task is None
        assert stand_ins.num_spawned == {"encoder-0": 2, "pd-0": 1} and pd.pid == pd_pid
        assert _metric(supervisor, "epd_launcher_restarts_total", "encoder-0") == 1
        assert any("encoder-0 killed by SIGKILL; restarting it on 127.0.0.1:5000" in line for line in said)
        assert any("encoder-0" in line and "ready again" in line for line in said)
    finally:
        supervisor.stop_all(grace_s=5)
    assert all(child.process.poll() is not None for child in supervisor.children)


# A stand-in that, on SIGTERM, notes which earlier tiers still run, waits until every sibling of its own tier
# was signalled too (they are stopped together), then exits: 0 if they were, 5 if it gave up waiting.
STOPS_WITH_ITS_TIER = """
import os, signal, sys, time
folder, name, siblings, earlier = {folder!r}, {name!r}, {siblings!r}, {earlier!r}
mark = lambda who, what: os.path.join(folder, who + "." + what)
def stop(*_):
    with open(mark(name, "term"), "w") as note:
        note.write(",".join(who for who in earlier if not os.path.exists(mark(who, "exited"))))
    end = time.monotonic() + 20
    while time.monotonic() < end and not all(os.path.exists(mark(who, "term")) for who in siblings):
        time.sleep(0.01)
    together = all(os.path.exists(mark(who, "term")) for who in siblings)
    open(mark(name, "exited"), "w").close()
    sys.exit(0 if together else 5)
signal.signal(signal.SIGTERM, stop)
open(mark(name, "up"), "w").close()
while True:
    time.sleep(1)
"""


async def test_stopping_goes_tier_by_tier_and_each_tier_stops_together(tmp_path):
    """Proxy, then every encoder at once, then every PD at once: a tier is not signalled before the one
    before it has exited, and one child's drain does not hold up its siblings' signals."""
    tiers = [["proxy"], ["encoder-0", "encoder-1"], ["pd-0", "pd-1"]]
    scripts = []
    for index, tier in enumerate(tiers):
        earlier = [name for before in tiers[:index] for name in before]
        for name in tier:
            siblings = [other for other in tier if other != name]
            script = STOPS_WITH_ITS_TIER.format(folder=str(tmp_path), name=name, siblings=siblings, earlier=earlier)
            scripts.append((name, script))

    async def handles_sigterm(spec: ServiceSpec, launch_key: str) -> bool:
        return (tmp_path / f"{spec.name}.up").exists()

    stand_ins = StandIns()
    supervisor = Supervisor(
        _specs(*reversed(scripts)), RestartPolicy(), is_ready=handles_sigterm, spawn=stand_ins.spawn
    )
    supervisor.start_all()
    await supervisor.wait_ready(30, asyncio.Event())
    supervisor.stop_all(grace_s=30)
    codes = {child.spec.name: child.process.returncode for child in supervisor.children}
    assert codes == dict.fromkeys(codes, 0), codes  # each was signalled together with its siblings
    still_running = {name: (tmp_path / f"{name}.term").read_text() for name, _ in scripts}
    assert still_running == dict.fromkeys(still_running, ""), still_running  # earlier tiers had exited


async def test_a_crash_loop_takes_out_only_that_service_while_the_others_keep_serving():
    """One replica's crash loop: it is left down and named; before, it stopped the whole cluster."""
    stand_ins, said = StandIns(), []
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.01)
    supervisor = Supervisor(
        _specs(("encoder-0", RUN_FOREVER), ("pd-0", RUN_FOREVER), ("proxy", RUN_FOREVER)),
        policy,
        is_ready=alive,
        spawn=stand_ins.spawn,
        say=said.append,
    )
    stop = asyncio.Event()
    try:
        supervisor.start_all()
        await supervisor.wait_ready(30, stop)
        stand_ins.scripts["encoder-0"] = CRASH  # every restart now fails at once
        os.kill(supervisor.children[0].pid, signal.SIGKILL)
        task = asyncio.create_task(supervisor.supervise(stop))
        await _until(lambda: _metric(supervisor, "epd_launcher_crash_looping", "encoder-0") == 1, "the crash loop")
        await asyncio.sleep(0.5)
        assert not task.done()  # supervision goes on for the others
        assert all(c.process.poll() is None for c in supervisor.children[1:])
        stop.set()
        assert await task is None
    finally:
        supervisor.stop_all(grace_s=5)
    assert stand_ins.num_spawned == {"encoder-0": 3, "pd-0": 1, "proxy": 1}  # the others were never touched
    assert _metric(supervisor, "epd_launcher_crash_looping", "pd-0") == 0
    [line] = [line for line in said if "crash-looping" in line]
    assert line.startswith(
        "epd: encoder-0 is crash-looping: it exited with code 3 after 2 restarts within 60s; it stays down, "
        "the others keep serving."
    )
    assert "| boom: port in use" in line  # its last output lines
    assert b"boom: port in use" in stand_ins.sink.getvalue()  # output is forwarded as it comes


async def test_a_crash_looping_proxy_ends_supervision_naming_it_with_its_last_lines():
    stand_ins = StandIns()
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.01)
    supervisor = Supervisor(
        _specs(("pd-0", RUN_FOREVER), ("proxy", RUN_FOREVER)),
        policy,
        is_ready=alive,
        spawn=stand_ins.spawn,
        say=lambda _: None,
    )
    stop = asyncio.Event()
    try:
        supervisor.start_all()
        await supervisor.wait_ready(30, stop)
        stand_ins.scripts["proxy"] = CRASH
        os.kill(supervisor.children[1].pid, signal.SIGKILL)
        crash = await asyncio.wait_for(supervisor.supervise(stop), 60)
    finally:
        supervisor.stop_all(grace_s=5)
    assert crash is not None and crash.name == "proxy"
    assert crash.exit == "exited with code 3" and crash.num_restarts == 2
    assert crash.tail[-1] == "boom: port in use"
    assert crash.message().startswith("proxy is crash-looping: it exited with code 3 after 2 restarts")
    assert "stopping the cluster" in crash.message()
    assert stand_ins.num_spawned["pd-0"] == 1


async def test_a_restarted_child_that_never_becomes_ready_is_killed_and_ends_in_a_crash_loop():
    stand_ins, said = StandIns(), []

    async def only_first_start_ready(spec, launch_key):  # a restart wedges in start-up (alive, never ready)
        return stand_ins.num_spawned[spec.name] == 1

    policy = RestartPolicy(max_restarts=1, window_s=60, backoff_s=0.01)
    supervisor = Supervisor(
        _specs(("pd-0", RUN_FOREVER), ("proxy", RUN_FOREVER)),
        policy,
        is_ready=only_first_start_ready,
        spawn=stand_ins.spawn,
        say=said.append,
        ready_timeout_s=0.3,
    )
    stop = asyncio.Event()
    try:
        supervisor.start_all()
        await supervisor.wait_ready(30, stop)
        os.kill(supervisor.children[0].pid, signal.SIGKILL)
        crash = await asyncio.wait_for(supervisor.supervise(stop), 60)
        wedged = supervisor.children[0].process
        assert wedged.wait(timeout=10) == -signal.SIGKILL  # killed by supervision, not left running
    finally:
        supervisor.stop_all(grace_s=5)
    assert crash is not None and crash.name == "pd-0" and crash.num_restarts == 1
    assert crash.exit == "did not become ready within 0.3s"
    assert any("pd-0 did not become ready within 0.3s; killing it" in line for line in said)
    assert stand_ins.num_spawned == {"pd-0": 2, "proxy": 1}


async def test_a_child_that_exits_during_start_up_aborts_with_its_output():
    stand_ins = StandIns()
    supervisor = Supervisor(_specs(("pd-0", CRASH)), RestartPolicy(), is_ready=alive, spawn=stand_ins.spawn)

    async def never_ready(spec, launch_key):
        return False

    supervisor._is_ready = never_ready
    try:
        supervisor.start_all()
        with pytest.raises(StartupFailed, match="pd-0 exited with code 3 during start-up") as failed:
            await supervisor.wait_ready(30, asyncio.Event())
        assert "boom: port in use" in str(failed.value)
        assert stand_ins.num_spawned == {"pd-0": 1}  # never restarted before the cluster was up
    finally:
        supervisor.stop_all(grace_s=5)


async def test_a_start_up_that_takes_too_long_is_reported():
    stand_ins = StandIns()

    async def never_ready(spec, launch_key):
        return False

    supervisor = Supervisor(
        _specs(("proxy", RUN_FOREVER)), RestartPolicy(), is_ready=never_ready, spawn=stand_ins.spawn
    )
    try:
        supervisor.start_all()
        with pytest.raises(StartupFailed, match="not ready after 0s: proxy"):
            await supervisor.wait_ready(0.1, asyncio.Event())
    finally:
        supervisor.stop_all(grace_s=5)


# -- finding 7: children's output is drained ------------------------------------------------
CHATTY = "import sys\nfor i in range(20000): print('request', i, 'x' * 80)\nsys.stdout.flush()\nsys.exit(7)"


async def test_a_childs_output_is_drained_when_nobody_reads_the_launchers_output():
    """A child logging ~1.8 MB while ``epd up``'s own stderr is an unread pipe: it must not block on its stdout.

    Before, the pump wrote each line to the launcher's stderr itself, so once that pipe's
    64 KiB filled, the pump stopped reading, the child's pipe filled and every write of the
    child blocked (the cluster froze after 302 requests' log lines).
    """
    read_end, write_end = os.pipe()  # the launcher's stderr that nobody reads
    sink = os.fdopen(write_end, "wb")
    forwarder = OutputForwarder(sink, max_pending_lines=100)
    process = subprocess.Popen([sys.executable, "-c", CHATTY], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail = OutputTail(process.stdout, forwarder)
    try:
        assert await asyncio.to_thread(process.wait, 30) == 7  # finished writing: never blocked
        assert tail.lines(wait_s=5)[-1].startswith("request 19999 ")
        assert forwarder.num_dropped > 0  # what the unread pipe could not take was dropped, not waited for
    finally:
        process.kill()
        os.close(read_end)  # the blocked write now fails (EPIPE); the writer thread carries on


# -- finding 7: health by RPC, not by process liveness --------------------------------------
HTTP_HEALTH = """
import http.server, os, sys
from services.common import launch_proof
class Health(http.server.BaseHTTPRequestHandler):  # a proxy's /health, answering epd up's challenge
    def do_GET(self):
        self.send_response(200)
        proof = launch_proof.answer(os.environ[launch_proof.LAUNCH_KEY_ENV], list(self.headers.items()))
        if proof is not None:
            self.send_header(launch_proof.PROOF_METADATA_KEY, proof)
        self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
print("up", flush=True)
server.serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_hung_child_is_detected_by_rpc_and_restarted():
    """A SIGSTOPped child is alive as a process but answers no RPC: it must be killed and restarted.

    Before, liveness was ``poll()``: the stopped child stayed "up" with 0 restarts.
    """
    port = _free_port()
    address = f"127.0.0.1:{port}"

    def spawn(spec: ServiceSpec):
        process = subprocess.Popen(
            [sys.executable, "-c", HTTP_HEALTH, str(port)],
            env={**os.environ, **spec.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        return process, OutputTail(process.stdout, OutputForwarder(io.BytesIO()))

    async def answers(spec: ServiceSpec, launch_key: str) -> bool:  # the launcher's liveness RPC for the proxy
        return await asyncio.to_thread(up._http_answers, spec.address, launch_key, 0.3)

    said: list[str] = []
    supervisor = Supervisor(
        [ServiceSpec("proxy", (), address, None)],
        RestartPolicy(max_restarts=3, window_s=60, backoff_s=0.05),
        is_ready=answers,
        is_alive=answers,
        health=HealthPolicy(interval_s=0.1, timeout_s=0.3, max_failures=3),
        spawn=spawn,
        say=said.append,
    )
    stop = asyncio.Event()
    stopped_pid = None
    try:
        supervisor.start_all()
        await supervisor.wait_ready(30, stop)
        task = asyncio.create_task(supervisor.supervise(stop))
        await asyncio.sleep(0.5)  # healthy checks pass: nothing happens
        assert _metric(supervisor, "epd_launcher_restarts_total", "proxy") == 0
        [child] = supervisor.children
        stopped_pid = child.pid
        os.kill(stopped_pid, signal.SIGSTOP)
        await _until(
            lambda: child.pid != stopped_pid and _metric(supervisor, "epd_launcher_service_up", "proxy") == 1,
            "the hung child restarted",
            timeout_s=20,
        )
        stop.set()
        assert await task is None
    finally:
        if stopped_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped_pid, signal.SIGKILL)
        supervisor.stop_all(grace_s=5)
    assert _metric(supervisor, "epd_launcher_health_kills_total", "proxy") == 1
    assert _metric(supervisor, "epd_launcher_restarts_total", "proxy") == 1
    assert any("proxy" in line and "did not answer 3 health checks in a row" in line for line in said)
    assert any("proxy stopped answering health checks (3 in a row); restarting it" in line for line in said)


# -- finding 7: a restarted child's port is verified before anything is trusted ---------------------
class RecordMetadata(grpc.aio.ServerInterceptor):
    """What every call to the impostor carried."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def intercept_service(self, continuation, handler_call_details):
        self.seen.extend((key, str(value)) for key, value in handler_call_details.invocation_metadata or ())
        return await continuation(handler_call_details)


async def _serving(launch_key: str | None, interceptor: RecordMetadata | None = None):
    server = await grpc_utils.start_server(
        "127.0.0.1",
        0,
        "epd.v1.PrefillDecode",
        lambda _: None,
        interceptors=[interceptor] if interceptor else [],
        security=InternalSecurity(launch_key=launch_key),
    )
    await server.set_ready(True)
    return server


async def test_a_listener_on_a_restarting_childs_port_never_receives_the_token():
    """A local process that binds a restarting PD's port and answers SERVING: not ready, no token.

    Before, the launcher's readiness and liveness calls carried the internal token to whatever
    listened on the port, and a listener answering SERVING was taken for the restarted child.
    """
    token = "t" * 32
    transport = InternalSecurity(token=token)
    recorder = RecordMetadata()
    impostor = await _serving(launch_key=None, interceptor=recorder)
    genuine_key = launch_proof.new_launch_key()
    genuine = await _serving(launch_key=genuine_key)
    try:
        is_ready, is_alive = up._ready_check(transport), up._alive_check(transport, 1.0)
        impostor_spec = ServiceSpec("pd-0", (), f"127.0.0.1:{impostor.port}", "epd.v1.PrefillDecode")
        for _ in range(5):
            assert not await is_ready(impostor_spec, launch_proof.new_launch_key())
            assert not await is_alive(impostor_spec, launch_proof.new_launch_key())
        assert recorder.seen and all(key != security.AUTH_METADATA_KEY for key, _ in recorder.seen)
        assert not any(token in value for _, value in recorder.seen)
        # The child started with the key proves it; the same child with another start's key does not.
        genuine_spec = ServiceSpec("pd-1", (), f"127.0.0.1:{genuine.port}", "epd.v1.PrefillDecode")
        assert await is_ready(genuine_spec, genuine_key) and await is_alive(genuine_spec, genuine_key)
        assert not await is_ready(genuine_spec, launch_proof.new_launch_key())
    finally:
        await impostor.stop(0)
        await genuine.stop(0)


async def test_health_calls_never_carry_the_token_to_whatever_listens():
    """The proxy's health watch and any probe use channels that attach the token: not to health."""
    recorder = RecordMetadata()
    listener = await _serving(launch_key=None, interceptor=recorder)
    token = "t" * 32
    try:
        async with grpc_utils.aio_channel(f"127.0.0.1:{listener.port}", InternalSecurity(token=token)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            async for _ in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5):
                break
            assert not any(token in value for _, value in recorder.seen)
            with pytest.raises(grpc.aio.AioRpcError):  # any other method still carries it
                await channel.unary_unary("/epd.v1.PrefillDecode/GetLoad")(b"", timeout=5)
            assert (security.AUTH_METADATA_KEY, f"Bearer {token}") in recorder.seen
    finally:
        await listener.stop(0)


def test_each_child_has_its_own_launch_key_and_the_proxy_is_given_its_peers():
    envs: list[tuple[str, dict]] = []

    def spawn(spec: ServiceSpec):
        envs.append((spec.name, dict(spec.env)))
        process = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE)
        return process, OutputTail(process.stdout, OutputForwarder(io.BytesIO()))

    specs = [
        ServiceSpec("pd-0", (), "127.0.0.1:5001", "epd.v1.PrefillDecode"),
        ServiceSpec("encoder-0", (), "127.0.0.1:5002", "epd.v1.Encoder"),
        ServiceSpec("proxy", (), "127.0.0.1:5003", None),
    ]
    supervisor = Supervisor(specs, RestartPolicy(), is_ready=alive, spawn=spawn)
    try:
        supervisor.start_all()
        supervisor._start(supervisor.children[0])  # a restart keeps the key the proxy knows
    finally:
        supervisor.stop_all(grace_s=5)
    key = {name: env[launch_proof.LAUNCH_KEY_ENV] for name, env in envs}
    assert len(set(key.values())) == 3 and all(len(k) == 64 for k in key.values())
    assert [env[launch_proof.LAUNCH_KEY_ENV] for name, env in envs if name == "pd-0"] == [key["pd-0"]] * 2
    proxy_env = dict(envs)["proxy"]
    assert dict(launch_proof.parse_peer_keys(proxy_env[launch_proof.PEER_KEYS_ENV])) == {
        "127.0.0.1:5001": key["pd-0"],
        "127.0.0.1:5002": key["encoder-0"],
    }
    assert all(launch_proof.PEER_KEYS_ENV not in env for name, env in envs if name != "proxy")


# -- the token in every child's environment ---------------------------
REPORT_SECRETS = """
import argparse, json, os, subprocess, sys
from services.common import security
in_environment = sorted(name for name in os.environ if name in security.SECRET_ENVS)
transport = security.from_args(argparse.Namespace())
with open("/proc/self/environ", "rb") as file:
    environ_bytes = file.read()
grandchild = subprocess.run(
    [sys.executable, "-c", "import os, sys; print(sorted(n for n in os.environ if n in sys.argv[1:]))",
     *security.SECRET_ENVS, "EPD_SECRETS_FD"],
    capture_output=True, text=True,
).stdout.strip()
print(json.dumps({
    "in_environment": in_environment,
    "token": transport.token,
    "launch_key": transport.launch_key,
    "token_in_proc_environ": transport.token.encode() in environ_bytes,
    "grandchild": grandchild,
}), flush=True)
"""


def test_the_internal_token_is_in_no_childs_environment(monkeypatch):
    """Before: ``epd up`` put the token in each child's environment, where it stayed for the child's
    life (``/proc/<pid>/environ``) and went on to everything the child started."""
    token, launch_key = "internal-token-0123456789", "k" * 64
    monkeypatch.setenv(security.TOKEN_ENV, token)  # given to epd up in its own environment
    spawn = ProcessSpawner(OutputForwarder(io.BytesIO()), command=(sys.executable, "-c", REPORT_SECRETS))
    spec = ServiceSpec("pd-0", (), "127.0.0.1:1", "epd.v1.PrefillDecode", {launch_proof.LAUNCH_KEY_ENV: launch_key})
    process, tail = spawn(spec)
    try:
        assert process.wait(30) == 0, tail.lines(wait_s=5)
        report = json.loads(tail.lines(wait_s=5)[-1])
    finally:
        process.kill()
    assert report["token"] == token and report["launch_key"] == launch_key  # the child has them
    assert report["in_environment"] == [] and not report["token_in_proc_environ"]
    assert report["grandchild"] == "[]"  # nothing the child starts inherits them either
