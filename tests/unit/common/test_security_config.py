"""``services/common/security.py`` without servers: validation, flags, the token comparison."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest

from services.common import security
from services.common.security import (
    NO_SECURITY,
    InternalSecurity,
    TokenCheckInterceptor,
)
from services.launcher import command as up

TOKEN = "0123456789abcdef-token"
PEM_CERT = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
PEM_KEY = b"-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"


def parse(argv: list[str], *, grpc_server: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    security.add_arguments(parser, grpc_server=grpc_server)
    return parser.parse_args(argv)


@pytest.fixture
def clean_env(monkeypatch):
    for name in (
        "EPD_INTERNAL_TOKEN",
        "EPD_INTERNAL_TOKEN_FILE",
        "EPD_TLS_CERT",
        "EPD_TLS_KEY",
        "EPD_TLS_CA",
        "EPD_TLS_SERVER_NAME",
        "EPD_GRPC_REFLECTION",
    ):
        monkeypatch.delenv(name, raising=False)


# -- the dataclass --------------------------------------------------------------
def test_default_is_plaintext_without_token_or_reflection():
    assert NO_SECURITY.describe() == "plaintext"
    assert NO_SECURITY.server_credentials() is None and NO_SECURITY.channel_credentials() is None
    assert NO_SECURITY.server_interceptors() == [] and NO_SECURITY.client_interceptors() == []
    assert NO_SECURITY.channel_options() == ()


@pytest.mark.parametrize(
    "token, problem",
    [
        ("short", "at least 16"),
        ("has a space in it, long enough", "printable ASCII"),
        ("non-ascii-é-token-long-enough", "printable ASCII"),
        ("tab\tseparated-long-enough-token", "printable ASCII"),
    ],
)
def test_weak_or_unsendable_tokens_are_refused_without_echoing_them(token, problem):
    with pytest.raises(ValueError, match=problem) as info:
        InternalSecurity(token=token)
    assert token not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"tls_cert": PEM_CERT}, "go together"),
        ({"tls_key": PEM_KEY}, "go together"),
        ({"tls_ca": PEM_CERT}, "need --tls-cert"),
        ({"tls_server_name": "pd.internal"}, "need --tls-cert"),
        ({"tls_cert": b"not pem", "tls_key": PEM_KEY}, "--tls-cert is not PEM"),
        ({"tls_cert": PEM_CERT, "tls_key": PEM_KEY, "tls_ca": b"junk"}, "--tls-ca is not PEM"),
    ],
)
def test_inconsistent_tls_settings_are_refused(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        InternalSecurity(**kwargs)


def test_describe_and_repr_never_show_secrets():
    config = InternalSecurity(token=TOKEN, tls_cert=PEM_CERT, tls_key=PEM_KEY, tls_ca=PEM_CERT, reflection=True)
    assert config.describe() == "mtls+token+reflection"
    assert repr(config) == "InternalSecurity(mtls+token+reflection)"
    assert InternalSecurity(tls_cert=PEM_CERT, tls_key=PEM_KEY).describe() == "tls"
    assert TOKEN not in repr(config) and "PRIVATE" not in repr(config)


def test_server_name_becomes_a_channel_option():
    config = InternalSecurity(tls_cert=PEM_CERT, tls_key=PEM_KEY, tls_server_name="pd.internal")
    assert config.channel_options() == (("grpc.ssl_target_name_override", "pd.internal"),)


def test_token_makes_one_client_interceptor_per_arity_and_a_server_check():
    config = InternalSecurity(token=TOKEN)
    kinds = (
        grpc.aio.UnaryUnaryClientInterceptor,
        grpc.aio.UnaryStreamClientInterceptor,
        grpc.aio.StreamUnaryClientInterceptor,
        grpc.aio.StreamStreamClientInterceptor,
    )
    interceptors = config.client_interceptors()
    assert [sum(isinstance(i, kind) for i in interceptors) for kind in kinds] == [1, 1, 1, 1]
    assert [type(i) for i in config.server_interceptors()] == [TokenCheckInterceptor]


# -- the comparison -------------------------------------------------------------
@pytest.mark.parametrize(
    "metadata, ok",
    [
        ((("authorization", f"Bearer {TOKEN}"),), True),
        ((("x-request-id", "r1"), ("authorization", f"Bearer {TOKEN}")), True),
        ((("authorization", f"Bearer {TOKEN}".encode()),), True),
        (None, False),
        ((), False),
        ((("authorization", TOKEN),), False),  # no scheme
        ((("authorization", f"Bearer {TOKEN}x"),), False),  # longer
        ((("authorization", f"Bearer {TOKEN[:-1]}"),), False),  # prefix
        ((("authorization", "Bearer é"),), False),  # non-ASCII does not raise
        ((("x-token", f"Bearer {TOKEN}"),), False),  # other key
    ],
)
def test_authorized_needs_exactly_the_bearer_token(metadata, ok):
    assert TokenCheckInterceptor(TOKEN).authorized(metadata) is ok


# -- flags ----------------------------------------------------------------------
def test_flags_read_files_and_stay_off_by_default(tmp_path: Path, clean_env):
    assert security.from_args(parse([]), environ={}) == NO_SECURITY
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "cert.pem").write_bytes(PEM_CERT)
    (tmp_path / "key.pem").write_bytes(PEM_KEY)
    args = parse(
        [
            "--internal-token-file",
            str(tmp_path / "token"),
            "--tls-cert",
            str(tmp_path / "cert.pem"),
            "--tls-key",
            str(tmp_path / "key.pem"),
            "--tls-ca",
            str(tmp_path / "cert.pem"),
            "--tls-server-name",
            "pd.internal",
            "--grpc-reflection",
        ]
    )
    config = security.from_args(args, environ={})
    assert config == InternalSecurity(
        token=TOKEN, tls_cert=PEM_CERT, tls_key=PEM_KEY, tls_ca=PEM_CERT, tls_server_name="pd.internal", reflection=True
    )


def test_token_from_the_environment(clean_env):
    assert security.from_args(parse([]), environ={"EPD_INTERNAL_TOKEN": TOKEN}).token == TOKEN


def test_flags_default_to_their_env_variables(tmp_path: Path, monkeypatch, clean_env):
    (tmp_path / "token").write_text(TOKEN)
    monkeypatch.setenv("EPD_INTERNAL_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("EPD_GRPC_REFLECTION", "1")
    config = security.from_args(parse([]), environ={})
    assert config.token == TOKEN and config.reflection


@pytest.mark.parametrize(
    "setup, problem",
    [
        ("both", "not both"),
        ("empty", "is empty"),
        ("missing", "cannot read --internal-token-file"),
        ("missing-cert", "cannot read --tls-cert"),
    ],
)
def test_bad_token_or_file_settings_are_usage_errors(tmp_path: Path, clean_env, setup, problem):
    token_file = tmp_path / "token"
    token_file.write_text("" if setup == "empty" else TOKEN)
    argv = {
        "both": ["--internal-token-file", str(token_file)],
        "empty": ["--internal-token-file", str(token_file)],
        "missing": ["--internal-token-file", str(tmp_path / "nope")],
        "missing-cert": ["--tls-cert", str(tmp_path / "nope"), "--tls-key", str(token_file)],
    }[setup]
    environ = {"EPD_INTERNAL_TOKEN": TOKEN} if setup == "both" else {}
    with pytest.raises(ValueError, match=problem) as info:
        security.from_args(parse(argv), environ=environ)
    assert TOKEN not in str(info.value)


def test_proxy_side_flags_have_no_reflection(clean_env):
    with pytest.raises(SystemExit):
        parse(["--grpc-reflection"], grpc_server=False)
    assert security.from_args(parse([], grpc_server=False), environ={}).reflection is False


def test_forward_argv_passes_only_what_was_set(clean_env):
    args = parse(["--tls-cert", "c.pem", "--tls-key", "k.pem", "--grpc-reflection"])
    assert security.forward_argv(args, grpc_server=True) == [
        "--tls-cert",
        "c.pem",
        "--tls-key",
        "k.pem",
        "--grpc-reflection",
    ]
    assert security.forward_argv(args, grpc_server=False) == ["--tls-cert", "c.pem", "--tls-key", "k.pem"]
    assert security.forward_argv(parse([]), grpc_server=True) == []


def test_epd_up_passes_the_flags_to_every_service(monkeypatch, clean_env):
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(
        ["--internal-token-file", "t", "--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a", "--grpc-reflection"]
    )
    spawned = {spec.name: list(spec.argv) for spec in up.service_specs(args)}
    flags = ["--internal-token-file", "t", "--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"]
    assert set(spawned) == {"encoder-0", "pd-0", "proxy"}
    for name, argv in spawned.items():
        tail = argv[argv.index("--internal-token-file") :]
        assert tail[: len(flags)] == flags, name
        assert ("--grpc-reflection" in argv) == (name != "proxy")


@pytest.mark.parametrize("service", ["encoder", "pd", "proxy"])
def test_every_service_takes_the_same_flags_into_its_config(tmp_path: Path, clean_env, service):
    import importlib

    main = importlib.import_module(f"services.{service}.main")
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "cert.pem").write_bytes(PEM_CERT)
    (tmp_path / "key.pem").write_bytes(PEM_KEY)
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(
        [
            "--internal-token-file",
            str(tmp_path / "token"),
            "--tls-cert",
            str(tmp_path / "cert.pem"),
            "--tls-key",
            str(tmp_path / "key.pem"),
            "--tls-ca",
            str(tmp_path / "cert.pem"),
        ]
    )
    assert main.config_from_args(args).security.describe() == "mtls+token"


@pytest.mark.parametrize("service", ["encoder", "pd", "proxy", "up"])
def test_unreadable_security_files_are_usage_errors_before_anything_starts(tmp_path: Path, clean_env, service):
    import importlib

    module = up if service == "up" else importlib.import_module(f"services.{service}.main")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(["--internal-token-file", str(tmp_path / "missing")])
    assert module.run(args) == 2
