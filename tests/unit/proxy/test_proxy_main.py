"""``epd proxy`` flags -> ProxyConfig."""

from __future__ import annotations

import argparse

import pytest

from services.proxy.main import add_arguments, config_from_args, run


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults():
    config = config_from_args(parse([]))
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    assert config.pd_addresses == ("127.0.0.1:21061",)
    assert config.encoder_addresses == ("127.0.0.1:21051",)
    assert config.served_model_name is None and config.max_body_bytes == 32 * 1024 * 1024


def test_flags_and_lists():
    args = parse(
        [
            "--pd",
            "a:1, b:2",
            "--encoder",
            "",
            "--max-images",
            "2",
            "--request-timeout",
            "5",
            "--served-model-name",
            "m",
            "--max-body-mb",
            "1",
        ]
    )
    config = config_from_args(args)
    assert config.pd_addresses == ("a:1", "b:2") and config.encoder_addresses == ()
    assert config.max_images_per_request == 2 and config.request_timeout_s == 5.0
    assert config.served_model_name == "m" and config.max_body_bytes == 1024 * 1024


def test_environment_supplies_defaults(monkeypatch):
    monkeypatch.setenv("EPD_PD", "x:9")
    monkeypatch.setenv("EPD_PORT", "9000")
    config = config_from_args(parse([]))
    assert config.pd_addresses == ("x:9",) and config.port == 9000


def test_nonsense_config_exits_with_usage_error(capsys):
    assert run(parse(["--pd", "", "--log-level", "error"])) == 2
    assert "PD address" in capsys.readouterr().out


def test_routing_access_and_media_flags():
    config = config_from_args(
        parse(
            [
                "--pd-policy",
                "round-robin",
                "--encoder-policy",
                "least-loaded",
                "--encoder-saturation",
                "4",
                "--pd-attempts",
                "2",
                "--encoder-attempts",
                "5",
                "--breaker-failures",
                "1",
                "--breaker-open-s",
                "0.5",
                "--load-poll-s",
                "0",
                "--dns-refresh-s",
                "1",
                "--max-n",
                "2",
                "--api-key",
                "k",
                "--allowed-media-domains",
                "img.example.com, *.cdn.org",
                "--media-timeout",
                "3",
                "--max-media-mb",
                "2",
            ]
        )
    )
    assert (config.pd_policy, config.encoder_policy, config.encoder_saturation) == ("round-robin", "least-loaded", 4)
    assert (config.pd_attempts, config.encoder_attempts, config.breaker_failures) == (2, 5, 1)
    assert (config.breaker_open_s, config.load_poll_s, config.dns_refresh_s, config.max_n) == (0.5, 0.0, 1.0, 2)
    assert config.api_key == "k" and config.allowed_media_domains == ("img.example.com", "*.cdn.org")
    assert config.media_timeout_s == 3.0 and config.max_media_bytes == 2 * 1024 * 1024


def test_preprocessing_pool_and_pixel_budget_flags():
    config = config_from_args(
        parse(
            [
                "--preprocess-threads",
                "3",
                "--text-queue",
                "5",
                "--image-threads",
                "4",
                "--image-queue",
                "0",
                "--max-request-pixels",
                "1000000",
            ]
        )
    )
    assert (config.preprocess_threads, config.text_queue, config.image_threads, config.image_queue) == (3, 5, 4, 0)
    assert config.max_request_pixels == 1_000_000
    with pytest.raises(ValueError):
        config_from_args(parse(["--image-queue", "-1"]))
    with pytest.raises(ValueError):
        config_from_args(parse(["--image-threads", "0"]))


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("EPD_API_KEY", "from-env")
    assert config_from_args(parse([])).api_key == "from-env"
    monkeypatch.delenv("EPD_API_KEY")
    assert config_from_args(parse([])).api_key is None


def test_a_built_in_preset_is_served_under_its_name():
    from services.proxy.lifespan import default_served_name

    assert default_served_name("", "tiny-v1") == "tiny"  # the README's curl example uses "tiny"
    assert default_served_name("bench", "bench-v1") == "bench"
    assert default_served_name("/models/llava", "llava") == "llava"


def test_ignore_unknown_fields_is_on_unless_turned_off(monkeypatch):
    assert config_from_args(parse([])).ignore_unknown_fields is True
    assert config_from_args(parse(["--no-ignore-unknown-fields"])).ignore_unknown_fields is False
    monkeypatch.setenv("EPD_IGNORE_UNKNOWN_FIELDS", "0")
    assert config_from_args(parse([])).ignore_unknown_fields is False
    assert config_from_args(parse(["--ignore-unknown-fields"])).ignore_unknown_fields is True


def test_help_explains_ignore_unknown_fields():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--ignore-unknown-fields" in text and "EPD_IGNORE_UNKNOWN_FIELDS" in text
    assert "X-EPD-Ignored-Fields" in text and "instead of refusing them with a 400" in text
    assert "--no-ignore-unknown-fields" in text


def test_time_limit_and_server_flags():
    from services.proxy.main import uvicorn_limits

    defaults = config_from_args(parse([]))
    assert (defaults.body_timeout_s, defaults.first_token_timeout_s, defaults.inter_token_timeout_s) == (30, 0, 60)
    assert defaults.write_timeout_s == 30 and uvicorn_limits(defaults) == {
        "limit_concurrency": 2048,
        "timeout_keep_alive": 5.0,
    }
    config = config_from_args(
        parse(
            [
                "--body-timeout-s",
                "2",
                "--first-token-timeout-s",
                "3",
                "--inter-token-timeout-s",
                "0",
                "--write-timeout-s",
                "4",
                "--max-concurrency",
                "0",
                "--keep-alive-timeout-s",
                "1",
            ]
        )
    )
    assert (config.body_timeout_s, config.first_token_timeout_s, config.inter_token_timeout_s) == (2, 3, 0)
    assert config.write_timeout_s == 4
    assert uvicorn_limits(config) == {"limit_concurrency": None, "timeout_keep_alive": 1.0}


def test_time_limit_flags_read_the_environment_and_refuse_nonsense(monkeypatch, capsys):
    monkeypatch.setenv("EPD_BODY_TIMEOUT_S", "7")
    assert config_from_args(parse([])).body_timeout_s == 7
    for bad in (["--body-timeout-s", "0"], ["--inter-token-timeout-s", "-1"], ["--max-concurrency", "-1"]):
        assert run(parse([*bad, "--log-level", "error"])) == 2
    capsys.readouterr()


def test_per_client_limits_are_off_by_default_and_read_flags_and_the_environment(monkeypatch, capsys):
    config = config_from_args(parse([]))
    assert config.max_requests_per_client == 0 and config.max_tokens_per_client_per_minute == 0
    config = config_from_args(parse(["--max-requests-per-client", "4", "--max-tokens-per-client-per-minute", "9000"]))
    assert config.max_requests_per_client == 4 and config.max_tokens_per_client_per_minute == 9000
    monkeypatch.setenv("EPD_MAX_REQUESTS_PER_CLIENT", "2")
    assert config_from_args(parse([])).max_requests_per_client == 2
    for bad in (["--max-requests-per-client", "-1"], ["--max-tokens-per-client-per-minute", "-5"]):
        assert run(parse([*bad, "--log-level", "error"])) == 2
    assert "max_requests_per_client" in capsys.readouterr().out


def test_cache_isolation_is_shared_unless_asked_and_only_known_modes_parse(monkeypatch, capsys):
    from services.proxy.cache_isolation import CacheIsolation

    monkeypatch.delenv("EPD_CACHE_ISOLATION", raising=False)
    assert config_from_args(parse([])).cache_isolation is CacheIsolation.SHARED
    assert config_from_args(parse(["--cache-isolation", "per-client"])).cache_isolation is CacheIsolation.PER_CLIENT
    monkeypatch.setenv("EPD_CACHE_ISOLATION", "per-client")
    assert config_from_args(parse([])).cache_isolation is CacheIsolation.PER_CLIENT
    with pytest.raises(SystemExit):
        parse(["--cache-isolation", "per-tenant"])
