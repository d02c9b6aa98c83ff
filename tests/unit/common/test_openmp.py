"""OpenMP teams: a model is loaded on a thread that ends, its team with it; threads that serve calls start none;
a spare team makes the workers sleep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from services.common import openmp

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
    out = {}
    before = threads()

    def load():
        torch.ones(1 << 20).mul_(2.0)  # a parallel op: the loading thread's team starts
        return torch.get_num_threads(), threads() - before

    out["loader_count"], out["loader_extra_threads"] = openmp.on_own_thread(load)
    out["extra_threads_after_load"] = settled(before) - before

    def fail():
        raise KeyError("no such model")

    try:
        openmp.on_own_thread(fail)
    except KeyError as error:
        out["raised"] = str(error)

    def helper():
        out["ran_alone"] = openmp.run_alone()
        alone = threads()
        torch.ones(1 << 20).mul_(2.0)  # parallel-sized: would start a team
        out["helper_extra_threads"] = threads() - alone
        out["helper_count"] = torch.get_num_threads()

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()

    async def service():
        openmp.leave_teams_to_model_threads()
        out["loop_count"] = torch.get_num_threads()
        out["to_thread_count"] = await asyncio.to_thread(torch.get_num_threads)
        out["loading_count"] = await asyncio.to_thread(openmp.on_own_thread, torch.get_num_threads)
        model = []
        thread = threading.Thread(target=lambda: model.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        out["model_thread_count"] = model[0]

    asyncio.run(service())

    alive = [True]
    workers = openmp.SleepingWorkers(lambda: alive[0], poll_s=0.05)
    workers.set(True)
    out["sleeping"] = settled(before + 2) - before  # its thread and that thread's spare team
    workers.set(False)
    out["spinning"] = settled(before) - before  # the thread ended, its team with it
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


def test_a_model_loads_on_a_thread_of_its_own_with_a_team_and_leaves_none_behind(observed):
    assert observed["loader_count"] == 2
    assert observed["loader_extra_threads"] == 2  # the loading thread and its worker
    assert observed["extra_threads_after_load"] == 0


def test_what_the_loader_raises_reaches_the_caller(observed):
    assert observed["raised"] == "'no such model'"


def test_sleeping_workers_hold_a_spare_team_only_while_asked_and_while_the_owner_lives(observed):
    # libgomp lets workers spin only while the process has no more OpenMP threads than CPUs: the spare team
    # is what makes them sleep (services/pd/shared_cores.py).
    assert observed["sleeping"] == 2
    assert observed["spinning"] == 0
    assert observed["sleeping_again"] == 2
    assert observed["owner_gone"] == 0


def test_a_thread_that_runs_alone_starts_no_team(observed):
    assert observed["ran_alone"] is True
    assert observed["helper_extra_threads"] == 0
    assert observed["helper_count"] == 1


def test_a_service_loop_and_its_helpers_run_alone_while_loading_and_the_model_thread_get_a_team(observed):
    assert observed["loop_count"] == 1
    assert observed["to_thread_count"] == 1
    assert observed["loading_count"] == 2
    assert observed["model_thread_count"] == 2


def test_on_own_thread_returns_the_value_in_process():
    assert openmp.on_own_thread(sum, [1, 2, 3]) == 6
