"""Must-show 3: a table of bad inputs against a real cluster.

Each one gets the expected 4xx OpenAI error, a bounded body that echoes
none of the input, and costs the backends nothing; afterwards the cluster
still serves and nothing is left reserved, pending or referenced. The table
runs against LLaVA, Qwen2.5-VL and Qwen3-VL: the refusals are the same.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import pytest
from cluster_support import InProcessCluster
from oracle_support import data_url, make_image
from PIL import Image

SECRET = "zq-secret-7781"
API_KEY = "test-key-1"
MAX_ERROR_BYTES = 1024
ALLOWED = ("localhost", "127.0.0.1", "169.254.169.254", "10.0.0.1")  # allowed by name, refused by address


def b64_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` (a decompression bomb's calling card)."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


GOOD = data_url(make_image(3, (32, 32)))
TRUNCATED = encoded(make_image(4, (64, 64)), "PNG")[:900]


def chat(*parts, **fields) -> dict:
    """A chat body with one user message of ``parts`` (strings become text parts, dicts are kept)."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts] or "hello"
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# (id, request, expected status, expected error code or None)
# request: {"json": ...} | {"content": bytes} plus optional "path" and "headers".
CASES = [
    ("malformed_json", {"content": b'{"messages": [' + SECRET.encode()}, 400, "invalid_request"),
    ("json_not_an_object", {"content": b'["' + SECRET.encode() + b'"]'}, 400, "invalid_request"),
    ("empty_body", {"content": b""}, 400, "invalid_request"),
    ("binary_garbage", {"content": bytes(range(256))}, 400, "invalid_request"),
    ("messages_missing", {"json": {"max_tokens": 3}}, 400, "invalid_request"),
    ("messages_empty", {"json": {"messages": []}}, 400, "invalid_request"),
    ("messages_wrong_type", {"json": {"messages": SECRET}}, 400, "invalid_request"),
    ("role_unknown", {"json": {"messages": [{"role": SECRET, "content": "hi"}]}}, 400, "invalid_request"),
    ("content_wrong_type", {"json": {"messages": [{"role": "user", "content": 42}]}}, 400, "invalid_request"),
    ("part_type_unknown", {"json": chat({"type": SECRET, "text": "x"})}, 400, "invalid_request"),
    ("image_part_without_url", {"json": chat({"type": "image_url", "image_url": {}})}, 400, "invalid_request"),
    ("max_tokens_string", {"json": chat(SECRET, max_tokens="ten")}, 400, "invalid_request"),
    ("max_tokens_negative", {"json": chat(SECRET, max_tokens=-5)}, 400, "invalid_request"),
    ("max_tokens_zero", {"json": chat(SECRET, max_tokens=0)}, 400, "invalid_request"),
    ("max_tokens_absurd", {"json": chat(SECRET, max_tokens=10**12)}, 400, "invalid_request"),
    ("max_completion_tokens_float", {"json": chat(SECRET, max_completion_tokens=2.5)}, 400, "invalid_request"),
    ("temperature_negative", {"json": chat(SECRET, temperature=-1)}, 400, "invalid_request"),
    ("temperature_absurd", {"json": chat(SECRET, temperature=1e9)}, 400, "invalid_request"),
    ("top_p_zero", {"json": chat(SECRET, top_p=0)}, 400, "invalid_request"),
    ("top_p_above_one", {"json": chat(SECRET, top_p=1.5)}, 400, "invalid_request"),
    ("top_logprobs_absurd", {"json": chat(SECRET, logprobs=True, top_logprobs=100)}, 400, "invalid_request"),
    ("top_logprobs_without_logprobs", {"json": chat(SECRET, top_logprobs=2)}, 400, "invalid_request"),
    ("n_zero", {"json": chat(SECRET, n=0)}, 400, "invalid_request"),
    ("n_absurd", {"json": chat(SECRET, n=10_000)}, 400, "invalid_request"),
    ("seed_negative", {"json": chat(SECRET, seed=-1)}, 400, "invalid_request"),
    ("stream_not_bool", {"json": chat(SECRET, stream="yes")}, 400, "invalid_request"),
    ("stop_too_many", {"json": chat(SECRET, stop=[SECRET] * 100)}, 400, "invalid_request"),
    ("stop_too_long", {"json": chat(SECRET, stop=SECRET * 100)}, 400, "invalid_request"),
    ("user_too_long", {"json": chat(SECRET, user=SECRET * 100)}, 400, "invalid_request"),
    ("logit_bias_not_an_id", {"json": chat(SECRET, logit_bias={SECRET: 5})}, 400, "invalid_request"),
    (
        "response_format_json_schema_without_schema",
        {"json": chat(SECRET, response_format={"type": "json_schema", "json_schema": {"name": SECRET}})},
        400,
        "invalid_request",
    ),
    (
        "guided_json_unknown_type",
        {"json": chat(SECRET, guided_json={"type": SECRET})},
        400,
        "invalid_request",
    ),
    (
        "tools_unsupported",
        {"json": chat(SECRET, tools=[{"type": "function", "function": {"name": SECRET}}])},
        400,
        "unsupported_parameter",
    ),
    ("unknown_model", {"json": chat(SECRET, model=SECRET)}, 404, "model_not_found"),
    ("unknown_field", {"json": chat(SECRET, colour=SECRET)}, 400, "unknown_parameter"),
    ("unknown_nested_key", {"json": chat({"type": "text", "text": "x", "colour": SECRET})}, 400, "unknown_parameter"),
    ("unimplemented_field", {"json": chat(SECRET, store=True)}, 400, "unsupported_parameter"),
    ("min_tokens_above_max_tokens", {"json": chat(SECRET, min_tokens=5)}, 400, "invalid_request"),
    ("min_tokens_negative", {"json": chat(SECRET, min_tokens=-1)}, 400, "invalid_request"),
    ("image_token_in_text", {"json": chat(f"{{image_token}} {SECRET}")}, 400, "invalid_image_placeholder"),
    ("prompt_too_long", {"json": chat("cat " * 3000 + SECRET)}, 400, "context_length_exceeded"),
    ("prompt_plus_max_tokens_too_long", {"json": chat(SECRET, max_tokens=2047)}, 400, "context_length_exceeded"),
    ("oversize_body", {"json": chat(SECRET + "x" * 300_000)}, 413, "request_too_large"),
    ("too_many_images", {"json": chat(SECRET, *[image(GOOD)] * 5)}, 400, "too_many_images"),
    ("bad_base64", {"json": chat(SECRET, image("data:image/png;base64,@@" + SECRET))}, 400, "invalid_image_base64"),
    (
        "base64_missing_padding",
        {"json": chat(SECRET, image("data:image/png;base64,aGVsbG8"))},
        400,
        "invalid_image_base64",
    ),
    (
        "base64_with_whitespace",
        {"json": chat(SECRET, image("data:image/png;base64,aGVs bG8="))},
        400,
        "invalid_image_base64",
    ),
    ("data_url_not_image", {"json": chat(SECRET, image(b64_url(b"hello", "text/plain")))}, 400, "invalid_image_url"),
    ("data_url_not_base64", {"json": chat(SECRET, image("data:image/png," + SECRET))}, 400, "invalid_image_url"),
    (
        "not_an_image",
        {"json": chat(SECRET, image(b64_url(b"%PDF-1.4 " + SECRET.encode() * 10)))},
        400,
        "unsupported_image_format",
    ),
    (
        "bmp_not_allowed",
        {"json": chat(SECRET, image(b64_url(encoded(make_image(5), "BMP"), "image/bmp")))},
        400,
        "unsupported_image_format",
    ),
    ("truncated_image", {"json": chat(SECRET, image(b64_url(TRUNCATED)))}, 400, "invalid_image_data"),
    (
        "decompression_bomb",
        {"json": chat(SECRET, image(b64_url(png_claiming(50_000, 50_000))))},
        400,
        "image_too_large",
    ),
    (
        "over_pixel_cap",
        {"json": chat(SECRET, image(b64_url(encoded(Image.new("L", (1000, 1000)), "PNG"))))},
        400,
        "image_too_large",
    ),
    ("scheme_http", {"json": chat(SECRET, image(f"http://localhost/{SECRET}.png"))}, 400, "image_url_not_allowed"),
    ("scheme_ftp", {"json": chat(SECRET, image(f"ftp://localhost/{SECRET}.png"))}, 400, "image_url_not_allowed"),
    ("scheme_file", {"json": chat(SECRET, image(f"file:///etc/{SECRET}"))}, 400, "image_url_not_allowed"),
    ("scheme_javascript", {"json": chat(SECRET, image(f"javascript:alert('{SECRET}')"))}, 400, "image_url_not_allowed"),
    (
        "domain_not_allowed",
        {"json": chat(SECRET, image(f"https://example.com/{SECRET}.png"))},
        400,
        "image_url_not_allowed",
    ),
    (
        "credentials_in_url",
        {"json": chat(SECRET, image(f"https://{SECRET}:pw@localhost/a.png"))},
        400,
        "image_url_not_allowed",
    ),
    (
        "loopback_by_name",
        {"json": chat(SECRET, image(f"https://localhost/{SECRET}.png"))},
        400,
        "image_url_not_allowed",
    ),
    (
        "loopback_literal",
        {"json": chat(SECRET, image(f"https://127.0.0.1:1/{SECRET}.png"))},
        400,
        "image_url_not_allowed",
    ),
    (
        "link_local_metadata",
        {"json": chat(SECRET, image(f"https://169.254.169.254/latest/{SECRET}"))},
        400,
        "image_url_not_allowed",
    ),
    ("private_address", {"json": chat(SECRET, image(f"https://10.0.0.1/{SECRET}.png"))}, 400, "image_url_not_allowed"),
    (
        "completion_token_ids_out_of_range",
        {"path": "/completions", "json": {"prompt": [10**6], "max_tokens": 2}},
        400,
        "invalid_request",
    ),
    (
        "completion_prompt_empty",
        {"path": "/completions", "json": {"prompt": [], "max_tokens": 2}},
        400,
        "invalid_request",
    ),
    (
        "completion_echo_with_logprobs_unsupported",
        {"path": "/completions", "json": {"prompt": SECRET, "echo": True, "logprobs": 1}},
        400,
        "unsupported_parameter",
    ),
    (
        "request_timeout_not_a_number",
        {"json": chat(SECRET), "headers": {"X-Request-Timeout": SECRET}},
        400,
        "invalid_request_timeout",
    ),
    ("api_key_missing", {"json": chat(SECRET), "headers": {"Authorization": ""}}, 401, "invalid_api_key"),
    ("api_key_wrong", {"json": chat(SECRET), "headers": {"Authorization": f"Bearer {SECRET}"}}, 401, "invalid_api_key"),
]


# The model's own image placeholder: text that contains it is refused whatever the family.
IMAGE_TOKENS = {"tiny": "<image>", "qwen2.5-vl-tiny": "<|image_pad|>", "qwen3-vl-tiny": "<|image_pad|>"}


@pytest.fixture(scope="module", params=list(IMAGE_TOKENS))
def cluster(request, build_model):
    cluster = InProcessCluster(
        str(build_model(request.param)),
        proxy={
            "max_body_bytes": 256 * 1024,
            "max_images_per_request": 4,
            "max_image_pixels": 512 * 512,
            "api_key": API_KEY,
            "allowed_media_domains": ALLOWED,
            # strict, so that the unknown-field cases check the refusal echoes nothing (served by default:
            # tests/integration/proxy/test_proxy_request_fields.py)
            "ignore_unknown_fields": False,
        },
    ).start()
    cluster.image_token = IMAGE_TOKENS[request.param]  # type: ignore[attr-defined]
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with httpx.Client(base_url=cluster.base_url, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


def _with_image_token(value: object, image_token: str) -> object:
    """``value`` with ``{image_token}`` in its strings replaced by the served model's placeholder."""
    if isinstance(value, str):
        return value.replace("{image_token}", image_token)
    if isinstance(value, list):
        return [_with_image_token(item, image_token) for item in value]
    if isinstance(value, dict):
        return {key: _with_image_token(item, image_token) for key, item in value.items()}
    return value


def send(client: httpx.Client, request: dict, image_token: str = "<image>") -> httpx.Response:
    headers = {"content-type": "application/json", **request.get("headers", {})}
    path = request.get("path", "/chat/completions")
    if "json" in request:
        return client.post(path, json=_with_image_token(request["json"], image_token), headers=headers)
    return client.post(path, content=request["content"], headers=headers)


def backend_calls(client: httpx.Client) -> str:
    metrics = client.get("/../metrics").text
    return "\n".join(line for line in metrics.splitlines() if line.startswith("epd_proxy_backend_requests_total"))


def test_at_least_thirty_cases():
    assert len(CASES) >= 30 and len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize(("request_spec", "status", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_bounded_openai_error(cluster, client, request_spec, status, code):
    before = backend_calls(client)
    reply = send(client, request_spec, cluster.image_token)
    assert reply.status_code == status, reply.text
    assert len(reply.content) <= MAX_ERROR_BYTES
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert SECRET not in reply.text and "aGVsbG8" not in reply.text and "@@" not in reply.text
    assert backend_calls(client) == before  # refused before any PD or encoder work


def test_cluster_still_serves_and_nothing_leaked(cluster, client):
    reply = client.post("/chat/completions", json=chat("Describe.", image(GOOD)))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert cluster.leaks() == {}
