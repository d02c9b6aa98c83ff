"""``secret_pipe``: secrets handed to a child on a pipe; every refusal of what the child is given."""

from __future__ import annotations

import os

import pytest

from services.common import secret_pipe

NAMES = ("EPD_INTERNAL_TOKEN", "EPD_LAUNCH_KEY")


def _pipe_holding(data: bytes) -> str:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, data)
    os.close(write_fd)
    return str(read_fd)


def test_secrets_leave_the_environment_and_come_back_from_the_pipe():
    env = {"EPD_INTERNAL_TOKEN": "t" * 20, "EPD_LAUNCH_KEY": "k" * 64, "PATH": "/bin"}
    fd = secret_pipe.hand_over(env, NAMES)
    assert fd is not None and env == {"PATH": "/bin", secret_pipe.SECRETS_FD_ENV: str(fd)}
    assert secret_pipe.receive(env) == {"EPD_INTERNAL_TOKEN": "t" * 20, "EPD_LAUNCH_KEY": "k" * 64}
    assert env == {"PATH": "/bin"}  # the descriptor's name is gone too
    with pytest.raises(OSError):
        os.fstat(fd)  # read once, then closed


def test_nothing_to_hand_over_makes_no_pipe():
    env = {"PATH": "/bin"}
    assert secret_pipe.hand_over(env, NAMES) is None and env == {"PATH": "/bin"}
    assert secret_pipe.receive(env) == {}


def test_secrets_too_large_for_the_pipe_are_refused():
    env = {"EPD_INTERNAL_TOKEN": "t" * secret_pipe.MAX_BYTES}
    with pytest.raises(ValueError, match="at most"):
        secret_pipe.hand_over(env, NAMES)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("three", "not a file descriptor"),
        ("999999", "no readable descriptor"),
    ],
)
def test_a_variable_that_names_no_pipe_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        secret_pipe.receive({secret_pipe.SECRETS_FD_ENV: value})


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b'["a list"]',
        b'{"EPD_INTERNAL_TOKEN": 7}',
        b'{"a": "' + b"x" * secret_pipe.MAX_BYTES + b'"}',
    ],
    ids=["not-json", "not-an-object", "not-text", "too-long"],
)
def test_a_pipe_that_holds_anything_else_is_refused_without_echo(data):
    with pytest.raises(ValueError, match="does not hold secrets") as info:
        secret_pipe.receive({secret_pipe.SECRETS_FD_ENV: _pipe_holding(data)})
    assert "json" not in str(info.value) and "xxx" not in str(info.value)
