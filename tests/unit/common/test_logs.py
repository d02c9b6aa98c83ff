"""Structured access lines: text and JSON rendering, request-id sanitizing, AccessLine statuses, --log-json."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import sys

import pytest

from services.common import cli_args, logs
from services.common.logs import AccessLine, format_fields, log_request, safe_request_id


@pytest.fixture
def capture():
    """A private logger whose records are kept (root handlers untouched)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("test_logs.capture")
    logger.handlers[:] = [Keep()]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, records
    logger.handlers.clear()


@pytest.mark.parametrize(
    "value, expected",
    [
        ("chatcmpl-0123abcd", "chatcmpl-0123abcd"),
        (b"req-1", "req-1"),
        ("trace:42/span.7_x", "trace:42/span.7_x"),
        ("a" * 128, "a" * 128),
        ("a" * 129, None),
        ("", None),
        ("-leading-dash", None),
        ("has space", None),
        ("line\nbreak", None),
        ('quote"d', None),
        ("naïve", None),
        (None, None),
        (42, None),
    ],
)
def test_safe_request_id(value, expected):
    assert safe_request_id(value) == expected


def test_text_line_is_key_value_and_quotes_anything_unusual():
    line = format_fields(
        "generate",
        {"request_id": "r-1", "status": "OK", "ms": 12.345, "stream": True, "pd": None, "odd": 'two words\n"x"'},
    )
    assert line == 'generate request_id=r-1 status=OK ms=12.3 stream=true pd=- odd="two words\\n\\"x\\""'
    assert "\n" not in line  # a value can never start a forged log line


def test_log_request_sets_record_fields(capture):
    logger, records = capture
    log_request(logger, "encode", request_id="r-2", items=2, cache_hits=1)
    (record,) = records
    assert record.getMessage() == "encode request_id=r-2 items=2 cache_hits=1"
    assert (record.event, record.request_id, record.items, record.cache_hits) == ("encode", "r-2", 2, 1)


def test_log_request_respects_level(capture):
    logger, records = capture
    logger.setLevel(logging.INFO)
    log_request(logger, "push", level=logging.DEBUG, request_id="r")
    assert records == []


def test_json_formatter_puts_fields_at_top_level():
    record = logging.LogRecord("svc.mod", logging.INFO, __file__, 1, "generate request_id=r-3", (), None)
    record.__dict__.update(
        event="generate",
        request_id="r-3",
        status="OK",
        ttft_ms=1.23456,
        completion_tokens=7,
        color_message="uvicorn's copy",
    )
    entry = json.loads(logs._JsonFormatter("pd").format(record))
    assert entry["service"] == "pd" and entry["level"] == "info" and entry["logger"] == "svc.mod"
    assert entry["msg"] == "generate"
    assert entry["request_id"] == "r-3" and entry["status"] == "OK"
    assert entry["ttft_ms"] == 1.235 and entry["completion_tokens"] == 7
    assert "color_message" not in entry


def test_json_formatter_plain_record_and_exception():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %d", (3,), exc_info=sys.exc_info())
    entry = json.loads(logs._JsonFormatter("proxy").format(record))
    assert entry["msg"] == "failed 3" and "ValueError: boom" in entry["exc"]
    assert "event" not in entry


def test_access_line_ok_with_counts_and_first_token(capture):
    logger, records = capture
    with AccessLine(logger, "generate", request_id="r-4", status=None, completion_tokens=0, ttft_ms=None) as line:
        line.mark_first_token()
        first = line.fields["ttft_ms"]
        line.mark_first_token()  # only the first call counts
        line.add("completion_tokens", 3)
        line.add("completion_tokens", 2)
        line.add("pd_attempts", 1)  # a counter that did not exist yet
    (record,) = records
    assert record.status == "OK" and record.completion_tokens == 5 and record.pd_attempts == 1
    assert record.ttft_ms == first and record.duration_ms >= first
    line.write()  # written once only
    assert len(records) == 1


@pytest.mark.parametrize(
    "error, status",
    [(asyncio.CancelledError, "CANCELLED"), (GeneratorExit, "CANCELLED"), (RuntimeError, "INTERNAL")],
)
def test_access_line_status_from_exception(capture, error, status):
    logger, records = capture
    with pytest.raises(error), AccessLine(logger, "generate", request_id="r-5", status=None):
        raise error()
    assert records[0].status == status


def test_access_line_keeps_a_status_set_before_the_exception(capture):
    logger, records = capture
    with pytest.raises(RuntimeError), AccessLine(logger, "preallocate", request_id="r-6") as line:
        line.update(status="UNAVAILABLE")
        raise RuntimeError("abort")
    assert records[0].status == "UNAVAILABLE"


def test_setup_logging_json_writes_one_object_per_line(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(logs.sys, "stderr", stream)
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        logs.setup_logging("info", service="encoder", json_format=True)
        log_request(logging.getLogger("t"), "encode", request_id="r-7", status="OK")
        logging.getLogger("t").info("plain %s", "message")
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    first, second = (json.loads(text) for text in stream.getvalue().splitlines())
    assert first["event"] == "encode" and first["service"] == "encoder" and first["request_id"] == "r-7"
    assert second["msg"] == "plain message"


def test_log_json_flag_reads_env(monkeypatch):
    def parse(argv):
        parser = argparse.ArgumentParser()
        cli_args.add_log_json_flag(parser)
        return parser.parse_args(argv).log_json

    monkeypatch.delenv("EPD_LOG_JSON", raising=False)
    assert parse([]) is False and parse(["--log-json"]) is True
    monkeypatch.setenv("EPD_LOG_JSON", "1")
    assert parse([]) is True and parse(["--no-log-json"]) is False
