"""Structured outputs in the engine: the matcher rides on its request through chunked prefill, preemption and
every exit; a refused token fails the request; a complete grammar stops it. Plus the wire's checks."""

from __future__ import annotations

import json

import pytest
from scheduler_harness import EOS, EOS_IDS, TOKEN, chunk_of, force_preempt

from services.common.pb import epd_pb2
from services.pd import convert, sampling_convert
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.outputs import Failed, TokenDelta
from services.pd.engine.request import RequestStatus, StructuredOutputSpec

REFUSED = 99


class GrammarDouble:
    """Accepts any token but ``REFUSED``; complete once it accepted EOS (as xgrammar's matcher)."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    @property
    def num_accepted_tokens(self) -> int:
        return len(self.accepted)

    def accept(self, token_id: int) -> bool:
        if token_id == REFUSED:
            return False
        self.accepted.append(token_id)
        return True

    @property
    def is_terminated(self) -> bool:
        return EOS in self.accepted


def _constrained(h, request_id: str, prompt, **sampling):
    request = h.add(request_id, prompt, structured_output=StructuredOutputSpec("json_object"), **sampling)
    request.grammar = grammar = GrammarDouble()  # the servicer attaches it before admission
    return request, grammar


def test_only_sampling_chunks_carry_the_grammar_and_every_token_advances_it(h):
    h.add("free", [1, 2, 3], max_tokens=3)
    request, grammar = _constrained(h, "a", list(range(1, 25)), max_tokens=3)  # 24 tokens: two prefill chunks
    out, _ = h.step()
    assert chunk_of(out, "a").grammar is None and not chunk_of(out, "a").sample
    assert chunk_of(out, "free").grammar is None
    out, _ = h.step()
    assert chunk_of(out, "a").grammar is grammar
    h.step()
    assert grammar.accepted == request.output_token_ids == [TOKEN, TOKEN]
    h.run()
    assert request.status is RequestStatus.FINISHED_LENGTH and request.grammar is None  # released


def test_a_complete_grammar_stops_the_request_even_when_eos_is_ignored(h):
    request, grammar = _constrained(h, "a", [1, 2, 3], max_tokens=8, ignore_eos=True)
    h.step()
    _, ended = h.step({"a": EOS})
    assert ended == [request] and request.status is RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [TOKEN, EOS] and grammar.accepted == [TOKEN, EOS]


def test_a_token_the_grammar_refuses_fails_the_request_without_streaming_it(h):
    request, grammar = _constrained(h, "a", [1, 2, 3], max_tokens=8)
    h.add("b", [4, 5, 6], max_tokens=2)
    h.step()
    h.runner.tokens = {"a": REFUSED}
    result = h.core.step()
    events = [event for request_id, event in result.events if request_id == "a"]
    assert [e.token_ids for e in events if isinstance(e, TokenDelta)] == []
    [failed] = [e for e in events if isinstance(e, Failed)]
    assert failed.error.kind is ErrorKind.INTERNAL
    assert request.status is RequestStatus.FINISHED_ERROR and request.output_token_ids == [TOKEN]
    assert grammar.accepted == [TOKEN] and request.grammar is None
    h.check()
    h.run()


def test_preemption_keeps_the_matcher_in_step_with_the_output(h):
    request, grammar = _constrained(h, "a", [1, 2, 3], max_tokens=6)
    h.step()
    h.step()
    force_preempt(h, request)
    assert grammar.accepted == request.output_token_ids == [TOKEN, TOKEN]
    out, _ = h.step()  # the recompute prefills prompt and output, then samples the next token
    assert chunk_of(out, "a").grammar is grammar
    assert grammar.accepted == request.output_token_ids == [TOKEN] * 3
    h.run()


def test_an_abort_releases_the_matcher(h):
    request, _ = _constrained(h, "a", [1, 2, 3], max_tokens=6)
    h.step()
    h.core.abort("a")
    assert request.status is RequestStatus.FINISHED_ABORTED and request.grammar is None


def test_integrity_check_catches_a_matcher_out_of_step(h):
    _, grammar = _constrained(h, "a", [1, 2, 3], max_tokens=6)
    h.step()
    grammar.accepted.append(TOKEN)
    with pytest.raises(AssertionError, match="grammar"):
        h.core.check_integrity()
    grammar.accepted.pop()
    h.run()


# ---------------------------------------------------------------------- the wire


def _sampling(constraint: epd_pb2.StructuredOutput, **fields) -> epd_pb2.SamplingParams:
    params = epd_pb2.SamplingParams(max_tokens=8, **fields)
    params.structured_output.CopyFrom(constraint)
    return params


@pytest.mark.parametrize(
    ("constraint", "spec"),
    [
        (
            epd_pb2.StructuredOutput(json_schema='{"type":"object"}'),
            StructuredOutputSpec("json_schema", '{"type":"object"}'),
        ),
        (epd_pb2.StructuredOutput(json_object=True), StructuredOutputSpec("json_object")),
        (epd_pb2.StructuredOutput(regex="[ab]+"), StructuredOutputSpec("regex", "[ab]+")),
        (
            epd_pb2.StructuredOutput(choice=epd_pb2.ChoiceList(choices=["x", "y"])),
            StructuredOutputSpec("choice", json.dumps(["x", "y"])),
        ),
        (epd_pb2.StructuredOutput(grammar='root ::= "a"'), StructuredOutputSpec("grammar", 'root ::= "a"')),
    ],
    ids=["json_schema", "json_object", "regex", "choice", "grammar"],
)
def test_the_wire_carries_each_constraint(constraint, spec):
    assert sampling_convert.sampling_from_pb(_sampling(constraint), 16).structured_output == spec
    assert sampling_convert.sampling_from_pb(epd_pb2.SamplingParams(max_tokens=8), 16).structured_output is None


@pytest.mark.parametrize(
    "params",
    [
        _sampling(epd_pb2.StructuredOutput()),
        _sampling(epd_pb2.StructuredOutput(json_object=False)),
        _sampling(epd_pb2.StructuredOutput(choice=epd_pb2.ChoiceList())),
        _sampling(epd_pb2.StructuredOutput(choice=epd_pb2.ChoiceList(choices=["x"] * 257))),
        _sampling(epd_pb2.StructuredOutput(regex="a" * (sampling_convert.MAX_CONSTRAINT_BYTES + 1))),
        _sampling(epd_pb2.StructuredOutput(json_object=True), min_tokens=2),
    ],
    ids=["no_constraint", "json_object_false", "no_choices", "too_many_choices", "too_large", "with_min_tokens"],
)
def test_the_wire_refuses_a_malformed_constraint(params):
    with pytest.raises(EngineError) as refused:
        sampling_convert.sampling_from_pb(params, 16)
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT


def test_requests_carry_the_eos_ids_the_grammar_stops_on():
    message = epd_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=[1, 2], sampling=_sampling(epd_pb2.StructuredOutput(json_object=True))
    )
    request = convert.request_from_pb(message, eos_token_ids=EOS_IDS, vocab_size=100, max_model_len=64)
    assert request.grammar is None and request.sampling.structured_output == StructuredOutputSpec("json_object")
