"""keep_freed_memory: glibc keeps a step's freed activations instead of faulting them in again."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import host_memory

REPO_ROOT = Path(__file__).resolve().parents[3]
ON_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.fixture
def no_user_choice(monkeypatch):
    for name in (*host_memory._USER_CHOICES, "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)


STEPS = """
import resource
import torch
from services.common import host_memory

def faults_of_steps(rows_per_step):
    # Prefill-like steps: per layer, two MLP activations, their product and a residual.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for rows in rows_per_step:
        hidden = torch.ones(rows, 768)
        for _ in range(3):
            gate, up = torch.ones(rows, 3072), torch.ones(rows, 3072)
            product = gate * up
            del gate, up
            hidden = hidden + product[:, :768]
            del product
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

assert host_memory.keep_freed_memory()
assert host_memory.keep_freed_memory()  # idempotent
rows = (2000, 1000, 1500, 2000, 1800)
faults_of_steps(rows)
faults_of_steps(rows)  # two rounds map what the largest steps need
print(faults_of_steps(rows))
"""


@pytest.mark.skipif(not ON_GLIBC, reason="mallopt is glibc's")
def test_steps_reuse_their_memory():
    """Steps of varied sizes (24 MiB activations at 2,000 rows): glibc's own thresholds kept
    faulting ~20,000-45,000 pages per round here, round after round. Counted in a fresh
    interpreter: page faults are the whole process's, and a long test session's heap is not a
    served model's."""
    env = {k: v for k, v in os.environ.items() if k not in (*host_memory._USER_CHOICES, "GLIBC_TUNABLES", "LD_PRELOAD")}
    done = subprocess.run(
        [sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) < 3000


@pytest.mark.parametrize(
    "name, value",
    [
        ("MALLOC_TRIM_THRESHOLD_", "0"),
        ("MALLOC_MMAP_MAX_", "0"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
        ("LD_PRELOAD", "libtcmalloc.so.4"),
    ],
)
def test_the_environment_choice_wins(monkeypatch, no_user_choice, name, value):
    monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda *args: calls.append(args))
    assert not host_memory.keep_freed_memory()
    assert calls == []


def test_other_c_libraries_are_left_alone(monkeypatch, no_user_choice):
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert not host_memory.keep_freed_memory()


def test_a_refused_setting_is_reported(monkeypatch, no_user_choice, caplog):
    if not ON_GLIBC:
        pytest.skip("reaches mallopt only on glibc")

    class Libc:  # test double: a C library whose mallopt refuses every setting
        @staticmethod
        def mallopt(param, value):
            return 0

    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda *args: Libc())
    with caplog.at_level("WARNING"):
        assert not host_memory.keep_freed_memory()
    assert "mallopt refused" in caplog.text
