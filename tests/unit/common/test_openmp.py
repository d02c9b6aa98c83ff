"""OpenMP teams: threads other than a service's model thread end theirs; the model thread keeps a whole one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from services.common import openmp

pytestmark = pytest.mark.skipif(openmp._libgomp() is None, reason="PyTorch runs on another OpenMP runtime here")

# Run in a process of its own: thread counts of the test process move with whatever else it runs.
SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, threading, time
    import torch
    from services.common import openmp

    def threads():
        return len(os.listdir("/proc/self/task"))

    def settled(expected):
        deadline = time.monotonic() + 5.0  # a freed worker leaves /proc a moment after it is told to
        while threads() != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        return threads()

    torch.set_num_threads(2)  # starts PyTorch's own (non-OpenMP) pool now, before any count
    out = {"team": openmp.team_threads()}

    def helper():
        alone = threads()
        torch.ones(1 << 20).mul_(2.0)  # a parallel op: this thread's team starts
        out["workers"] = threads() - alone
        out["ended"] = openmp.end_team()
        out["workers_after_end"] = settled(alone) - alone
        torch.ones(1 << 20).mul_(2.0)
        out["workers_after_op"] = threads() - alone
        out["helper_count"] = torch.get_num_threads()
        out["count_in_then"] = openmp.then_end_team(torch.get_num_threads)
        out["count_after_then"] = torch.get_num_threads()
        out["workers_after_then"] = settled(alone) - alone

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()

    async def service():
        openmp.leave_teams_to_model_threads()
        out["loop_count"] = torch.get_num_threads()
        out["to_thread_count"] = await asyncio.to_thread(torch.get_num_threads)
        out["loading_count"] = await asyncio.to_thread(openmp.then_end_team, torch.get_num_threads)
        model = []
        thread = threading.Thread(target=lambda: model.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        out["model_thread_count"] = model[0]

    asyncio.run(service())

    alive = [True]
    before = threads()
    workers = openmp.SleepingWorkers(lambda: alive[0], poll_s=0.05)
    workers.set(True)
    out["sleeping"] = settled(before + 2) - before  # its thread and that thread's spare team
    workers.set(False)
    out["spinning"] = settled(before + 1) - before  # the spare team ended; the thread waits
    workers.set(True)
    out["sleeping_again"] = settled(before + 2) - before
    alive[0] = False
    out["owner_gone"] = settled(before) - before
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def observed() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # a team of two even on a one-CPU runner
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ending_a_team_frees_its_workers_and_starts_none_again(observed):
    assert observed["team"] == 2
    assert observed["workers"] == 1
    assert observed["ended"] is True
    assert observed["workers_after_end"] == 0
    assert observed["workers_after_op"] == 0  # later parallel regions run on the thread alone
    assert observed["helper_count"] == 1


def test_then_end_team_loads_with_a_whole_team_and_ends_it_after(observed):
    assert observed["count_in_then"] == 2
    assert observed["count_after_then"] == 1
    assert observed["workers_after_then"] == 0


def test_sleeping_workers_hold_a_spare_team_only_while_asked_and_while_the_owner_lives(observed):
    # libgomp lets workers spin only while the process has no more OpenMP threads than CPUs: the spare team
    # is what makes them sleep (services/pd/shared_cores.py).
    assert observed["sleeping"] == 2
    assert observed["spinning"] == 1
    assert observed["sleeping_again"] == 2
    assert observed["owner_gone"] == 0


def test_a_service_loop_and_its_helpers_run_alone_while_the_model_thread_gets_a_whole_team(observed):
    assert observed["loop_count"] == 1
    assert observed["to_thread_count"] == 1
    assert observed["loading_count"] == 2
    assert observed["model_thread_count"] == 2  # read per thread: a thread whose team ended must not set it
