"""Schema fuzzing: schemathesis against the proxy's own OpenAPI document, on a real cluster.

The proxy, one encoder and one PD (tiny model) run in-process; schemathesis
loads ``/openapi.json`` over HTTP and generates requests from it, valid
(positive) and invalid (negative) ones. Every response must be no 5xx,
declared in the document (status, content type, body schema), and every
error must be an OpenAI error object of at most 1 KiB. Generation stays
short: the proxy's ``max_tokens_limit`` refuses long asks and its default
covers requests that name none (the tiny model never emits EOS). After the
run nothing may be left reserved, pending or referenced.
"""

from __future__ import annotations

import collections
import json

import httpx
import pytest
import schemathesis
from cluster_support import InProcessCluster
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MAX_ERROR_BYTES = 1024
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
GENERATION = ("/v1/chat/completions", "/v1/completions")
EXAMPLES = 40  # per endpoint and mode (300 each found nothing that 40 did not)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    cluster = InProcessCluster(
        str(tiny_model_dir),
        proxy={"max_tokens_limit": 8, "default_max_tokens": 4, "max_n": 2, "request_timeout_s": 60},
    ).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def schema(cluster):
    return schemathesis.openapi.from_url(f"http://127.0.0.1:{cluster.port}/openapi.json")


def check_error_body(response) -> None:
    """An error is OpenAI error JSON, bounded, naming a type and (maybe) a code; never a bare page."""
    if response.status_code < 400:
        return
    assert len(response.content) <= MAX_ERROR_BYTES, f"{len(response.content)}-byte error body"
    body = json.loads(response.content)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["type"]
    if response.status_code == 503:
        assert int(response.headers["Retry-After"]) >= 1


def fuzz(schema, path: str, method: str, mode: GenerationMode, max_examples: int) -> collections.Counter:
    """Runs ``max_examples`` generated requests (derandomized) and returns their status counts."""
    statuses: collections.Counter = collections.Counter()

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=schema[path][method].as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(timeout=60)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)
        check_error_body(response)

    run()
    return statuses


@pytest.mark.parametrize("path", GENERATION)
def test_generation_endpoints_survive_valid_and_invalid_bodies(cluster, schema, path):
    positive = fuzz(schema, path, "POST", GenerationMode.POSITIVE, EXAMPLES)
    negative = fuzz(schema, path, "POST", GenerationMode.NEGATIVE, EXAMPLES)
    assert positive[200] > 0, "no generated request reached the model: the fuzzing is vacuous"
    assert sum(negative.values()) > 0 and not any(status < 300 for status in negative)
    assert cluster.leaks() == {}


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/health/live", "/metrics"])
def test_read_endpoints_conform(cluster, schema, path):
    statuses = fuzz(schema, path, "GET", GenerationMode.POSITIVE, 5)
    assert statuses[200] > 0


def test_model_retrieval_conforms(cluster, schema):
    statuses = fuzz(schema, "/v1/models/{model_id}", "GET", GenerationMode.POSITIVE, 10)
    assert sum(statuses.values()) > 0 and set(statuses) <= {200, 404}  # generated ids are unknown models


def test_a_top_p_below_float32_range_is_served(cluster):
    """Found by fuzzing: top_p=5e-324 is valid (> 0) but was 0 on the float32 wire, which PD refuses."""
    response = httpx.post(cluster.base_url + "/completions", json={"prompt": "hi", "top_p": 5e-324}, timeout=60)
    assert response.status_code == 200, response.text
    assert cluster.leaks() == {}


def test_the_document_describes_every_route(cluster, schema):
    operations = {(op.method.upper(), op.path) for op in (result.ok() for result in schema.get_all_operations())}
    assert operations == {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/{model_id}"),
        ("GET", "/health"),
        ("GET", "/health/live"),
        ("GET", "/metrics"),
    }
    document = httpx.get(f"http://127.0.0.1:{cluster.port}/openapi.json").json()
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 8 and chat["n"]["anyOf"][0]["maximum"] == 2  # this server's
