"""Without the optional ``structured`` extra (xgrammar), a cluster serves everything but structured outputs,
and refuses those with a 400 that names the extra.

xgrammar is installed wherever the tests run (the ``test`` extra carries it), so
its absence is a test double: ``sys.modules["xgrammar"] = None`` makes every
``import xgrammar`` raise ImportError, for the PD's start-up and its requests.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import openai
import pytest
from cluster_support import InProcessCluster, checked_client

from services.common import grpc_utils
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.pd.runner.grammar import structured_outputs_installed

INSTALL_HINT = "pip install 'epd-cluster[structured]'"


@pytest.fixture(scope="module")
def xgrammar_missing():
    """Test double: xgrammar cannot be imported for the module's tests (as without the ``structured`` extra)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "xgrammar", None)
        assert not structured_outputs_installed()
        yield


@pytest.fixture(scope="module")
def cluster(xgrammar_missing, tiny_model_dir):
    started = InProcessCluster(str(tiny_model_dir), num_encoders=0).start()
    yield started
    started.stop()


@pytest.fixture
def client(cluster):
    yield from checked_client(cluster)


def _refusal(error: openai.BadRequestError) -> dict:
    """The OpenAI error object of a 400 (the SDK keeps the body's ``error`` member)."""
    assert error.status_code == 400 and isinstance(error.body, dict)
    return error.body.get("error", error.body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_structured_output_request_is_a_400_naming_the_extra(client, stream):
    with pytest.raises(openai.BadRequestError) as refused:
        reply = client.chat.completions.create(
            model="tiny",
            max_tokens=8,
            stream=stream,
            messages=[{"role": "user", "content": "a JSON object, please"}],
            response_format={"type": "json_object"},
        )
        if stream:
            list(reply)
    body = _refusal(refused.value)
    assert body["code"] == "structured_outputs_unavailable" and body["type"] == "invalid_request_error"
    assert INSTALL_HINT in body["message"]


def test_every_constraint_spelling_is_refused_the_same_way(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_regex": "[ab]+"})
    assert _refusal(refused.value)["code"] == "structured_outputs_unavailable"


def test_everything_else_still_serves(client):
    reply = client.chat.completions.create(
        model="tiny", max_tokens=6, temperature=0, messages=[{"role": "user", "content": "hello"}]
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=4, stream=False)
    assert text.usage.completion_tokens == 4


def test_pd_answers_failed_precondition_with_the_extras_name(cluster):
    sampling = epd_pb2.SamplingParams(temperature=0.0, max_tokens=4)
    sampling.structured_output.regex = "[ab]+"
    request = epd_pb2.GenerateRequest(request_id="no-extra-1", prompt_token_ids=[5, 6, 7], sampling=sampling)
    with grpc.insecure_channel(cluster.pd_addresses[0]) as channel, pytest.raises(grpc.RpcError) as refused:
        list(epd_pb2_grpc.PrefillDecodeStub(channel).Generate(request, timeout=30))
    error = refused.value
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION  # the instance is fine: no breaker counts it
    assert dict(error.trailing_metadata())[grpc_utils.MISSING_EXTRA_KEY] == "structured"
    assert INSTALL_HINT in error.details()
    assert cluster.leaks() == {}


def test_pd_imports_without_xgrammar():
    check = (
        "import sys; sys.modules['xgrammar'] = None; "
        "import services.pd.server, services.pd.servicer, services.pd.runner.model_runner, services.pd.main"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
