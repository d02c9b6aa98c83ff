"""Generate's grammar step on PD: a constrained request gets its matcher before admission; a server without
a compiler refuses it (FAILED_PRECONDITION, naming the ``structured`` extra where xgrammar is missing); a
constraint that does not compile (or not in time) is INVALID_ARGUMENT, a full compile queue RESOURCE_EXHAUSTED
with a retry hint, a compiler that cannot compile now UNAVAILABLE."""

from __future__ import annotations

import sys
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.request import Request, SamplingParams, StructuredOutputSpec
from services.pd.runner.grammar import GrammarBusy, GrammarError, GrammarUnavailable, structured_outputs_installed
from services.pd.servicer import MissingExtraError, PrefillDecodeServicer

SPEC = StructuredOutputSpec("regex", "a+")


class CompilerDouble:
    """``GrammarCompiler.submit``: a finished future with ``outcome`` (a matcher, or an error to raise)."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome
        self.specs: list[StructuredOutputSpec] = []

    def submit(self, spec):
        self.specs.append(spec)
        if isinstance(self.outcome, GrammarBusy):
            raise self.outcome
        future: Future = Future()
        if isinstance(self.outcome, Exception):
            future.set_exception(self.outcome)
        else:
            future.set_result(self.outcome)
        return future


def _request(spec=SPEC) -> Request:
    return Request("r", [1, 2], SamplingParams(structured_output=spec))


async def _attach(grammars, request: Request) -> None:
    await PrefillDecodeServicer._attach_grammar(SimpleNamespace(grammars=grammars), request)


async def test_a_constrained_request_gets_its_matcher():
    matcher = object()
    compiler = CompilerDouble(matcher)
    request = _request()
    await _attach(compiler, request)
    assert request.grammar is matcher and compiler.specs == [SPEC]


async def test_a_free_request_compiles_nothing():
    compiler = CompilerDouble(object())
    request = _request(spec=None)
    await _attach(compiler, request)
    assert request.grammar is None and compiler.specs == []


async def test_a_server_without_a_compiler_refuses_constraints():
    with pytest.raises(EngineError) as refused:
        await _attach(None, _request())
    assert refused.value.kind is ErrorKind.FAILED_PRECONDITION


@pytest.fixture
def xgrammar_missing(monkeypatch):
    """Test double: ``import xgrammar`` fails, as where the ``structured`` extra is not installed."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    assert not structured_outputs_installed()


async def test_without_xgrammar_a_constraint_is_refused_naming_the_extra(xgrammar_missing):
    with pytest.raises(MissingExtraError) as refused:
        await _attach(None, _request())
    assert refused.value.kind is ErrorKind.FAILED_PRECONDITION and refused.value.extra == "structured"
    assert "pip install 'epd-cluster[structured]'" in refused.value.message


async def test_without_xgrammar_a_free_request_is_unaffected(xgrammar_missing):
    request = _request(spec=None)
    await _attach(None, request)
    assert request.grammar is None


async def test_a_constraint_that_does_not_compile_is_invalid_argument():
    request = _request()
    with pytest.raises(EngineError) as refused:
        await _attach(CompilerDouble(GrammarError("the structured output constraint could not be compiled")), request)
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT and request.grammar is None


@pytest.mark.parametrize(
    ("outcome", "kind"),
    [
        (
            GrammarBusy("too many structured output constraints are waiting to be compiled"),
            ErrorKind.RESOURCE_EXHAUSTED,
        ),
        (GrammarUnavailable("the grammar compile process could not be started"), ErrorKind.UNAVAILABLE),
        (GrammarError("the structured output constraint takes longer than 5s to compile"), ErrorKind.INVALID_ARGUMENT),
    ],
    ids=["busy", "unavailable", "overrun"],
)
async def test_compile_refusals_keep_their_meaning(outcome, kind):
    request = _request()
    with pytest.raises(EngineError) as refused:
        await _attach(CompilerDouble(outcome), request)
    assert refused.value.kind is kind and request.grammar is None
    assert (refused.value.retry_after_s is not None) == (kind is ErrorKind.RESOURCE_EXHAUSTED)
