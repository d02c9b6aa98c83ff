"""The grammar side of the runner: compiling each constraint (cached, errors that quote nothing), matchers,
masks for an LM head wider than the tokenizer, and the sampler obeying them, greedy and random."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
from transformers import AutoTokenizer

from services.pd.engine.request import SamplingParams, StructuredOutputSpec
from services.pd.runner.grammar import (
    BitmaskFiller,
    CompileLimits,
    GrammarBusy,
    GrammarCompiler,
    GrammarError,
    GrammarUnavailable,
    apply_bitmask,
)
from services.pd.runner.grammar_compile import CompileUnavailable, Preflight, json_safe_strings
from services.pd.runner.sampler import Sampler

SECRET = "zebra-secret-42"
EXTRA_ROWS = 40  # LM-head rows past the tokenizer's


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(
        tokenizer, vocab_size=len(tokenizer) + EXTRA_ROWS, stop_token_ids=(tokenizer.eos_token_id,)
    )
    yield compiler
    compiler.shutdown()


def _allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    ids = torch.arange(vocab_size)
    return ids[((bitmask[row][ids // 32] >> (ids % 32)) & 1).bool()].tolist()


def _walk(compiler, tokenizer, spec: StructuredOutputSpec, seed: int = 0, max_steps: int = 200) -> str:
    """Random allowed tokens until the grammar completes; the text without the stop token."""
    matcher = compiler.matcher(spec)
    filler, rng, tokens = BitmaskFiller(compiler.vocab_size), random.Random(seed), []
    while not matcher.is_terminated:
        assert len(tokens) < max_steps, "did not complete"
        allowed = _allowed(filler.fill([matcher]), 0, compiler.vocab_size)
        assert allowed and max(allowed) < len(tokenizer)  # the head's padding rows are never allowed
        token = rng.choice(allowed)
        assert matcher.accept(token)
        tokens.append(token)
    assert matcher.num_accepted_tokens == len(tokens) and tokens[-1] == tokenizer.eos_token_id
    return tokenizer.decode(tokens[:-1])


@pytest.mark.parametrize("seed", range(3))
def test_each_kind_of_constraint_yields_matching_text(compiler, tokenizer, seed):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "s": {"type": "string", "maxLength": 4}},
        "required": ["n", "s"],
    }
    value = json.loads(_walk(compiler, tokenizer, StructuredOutputSpec("json_schema", json.dumps(schema)), seed))
    assert 0 <= value["n"] <= 9 and len(value["s"]) <= 4
    assert _walk(compiler, tokenizer, StructuredOutputSpec("regex", "[ab]{2}-[0-9]"), seed)[2] == "-"
    choices = ['a "quoted" one', "naïve", "x\\y"]
    assert _walk(compiler, tokenizer, StructuredOutputSpec("choice", json.dumps(choices)), seed) in choices
    assert _walk(compiler, tokenizer, StructuredOutputSpec("grammar", 'root ::= "yes" | "no"'), seed) in ("yes", "no")


def test_json_object_gives_an_object(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutputSpec("json_object"))
    for token in tokenizer.encode("[1]", add_special_tokens=False)[:1]:
        assert not matcher.accept(token)  # an array is not an object
    assert matcher.num_accepted_tokens == 0
    for token in tokenizer.encode('{"a": 1}', add_special_tokens=False):
        assert matcher.accept(token)
    assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated


def test_compiled_grammars_are_cached_by_spec_and_matchers_are_fresh(compiler):
    spec = StructuredOutputSpec("regex", "[xyz]+")
    first, second = compiler.submit(spec).result(), compiler.submit(StructuredOutputSpec("regex", "[xyz]+"))
    assert second.done()  # a cached constraint is answered at once, never behind a compile
    assert first is not second.result() and first.compiled is second.result().compiled
    assert first.num_accepted_tokens == second.result().num_accepted_tokens == 0


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputSpec("json_schema", json.dumps({"type": "object", "$ref": f"#/definitions/{SECRET}"})),
        StructuredOutputSpec("json_schema", json.dumps({"type": SECRET})),
        StructuredOutputSpec("json_schema", "{" + SECRET),
        StructuredOutputSpec("regex", f"({SECRET}"),
        StructuredOutputSpec("grammar", f"root ::= {SECRET}"),
        StructuredOutputSpec(SECRET, SECRET),
    ],
    ids=["dangling_ref", "unknown_type", "not_json", "bad_regex", "bad_grammar", "unknown_kind"],
)
def test_a_constraint_that_does_not_compile_raises_without_quoting_it(compiler, spec):
    with pytest.raises(GrammarError) as refused:
        compiler.submit(spec).result()
    assert SECRET not in str(refused.value)


def test_bounded_strings_keep_their_bounds_and_only_the_characters_json_allows(compiler, tokenizer):
    """xgrammar 0.2.8 lets control characters into a length-bounded string (the output then does not
    parse); its own repetition keeps the bounds, with JSON's characters."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 3}}}
    matcher = compiler.matcher(StructuredOutputSpec("json_schema", json.dumps(schema)))
    for token in tokenizer.encode('{"s": "', add_special_tokens=False):
        assert matcher.accept(token)
    control = [t for t in range(len(tokenizer)) if any(ord(c) < 0x20 for c in tokenizer.decode([t]))]
    bitmask = BitmaskFiller(compiler.vocab_size).fill([matcher])
    assert control and not set(control) & set(_allowed(bitmask, 0, compiler.vocab_size))
    for seed in range(3):
        spec = StructuredOutputSpec("json_schema", json.dumps(schema))
        value = json.loads(_walk(compiler, tokenizer, spec, seed))  # parses: no raw control character
        assert 2 <= len(value.get("s", "ab")) <= 3


def test_json_safe_strings_rewrites_only_the_bounded_strings_character_rule():
    rule = r"root_characters ::= (([^\"\\\r\n]))"  # as xgrammar 0.2.8 writes it
    ebnf = 'root ::= (("\\"" root_characters{0, 9000} "\\""))\n' + rule + "\n"
    assert json_safe_strings(ebnf) == ebnf.replace(rule, r"root_characters ::= (([^\0-\x1f\"\\]))")
    other = r'root ::= (("a") | ([^\"\\\r\n]))'  # the same class inside another body: left alone
    assert json_safe_strings(other) == other


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_length", [4000, 9000])
def test_long_bounded_strings_compile_in_well_under_the_time_bound(compiler, max_length):
    """As a pattern these took 24-47 s (4000) and over 200 s (9000) on an 8k vocabulary."""
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": max_length}}}
    matcher = compiler.matcher(StructuredOutputSpec("json_schema", json.dumps(schema)))
    assert matcher.num_accepted_tokens == 0


def test_free_rows_are_all_ones_and_apply_masks_only_the_given_rows(compiler):
    matcher = compiler.matcher(StructuredOutputSpec("choice", json.dumps(["yes"])))
    bitmask = BitmaskFiller(compiler.vocab_size).submit([None, matcher]).result()
    assert len(_allowed(bitmask, 0, compiler.vocab_size)) == compiler.vocab_size
    allowed = _allowed(bitmask, 1, compiler.vocab_size)
    scores = torch.randn(2, compiler.vocab_size)
    masked = apply_bitmask(scores, bitmask, [1])
    assert torch.equal(masked[0], scores[0])  # a free row is untouched
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == allowed
    assert torch.isfinite(scores).all()  # the input (the logprobs' logits) is left alone


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(seed=3, top_k=50)])
def test_the_sampler_takes_only_allowed_tokens_and_reports_unmasked_logprobs(compiler, params):
    matcher = compiler.matcher(StructuredOutputSpec("regex", "[0-9]+"))
    bitmask = BitmaskFiller(compiler.vocab_size).fill([matcher, None])
    allowed = set(_allowed(bitmask, 0, compiler.vocab_size))
    logits = torch.randn(2, compiler.vocab_size, generator=torch.Generator().manual_seed(0)) * 5
    free = Sampler().sample(logits, [params, params], [0, 0])[1]
    out = Sampler().sample(logits, [params, params], [0, 0], grammar_bitmask=bitmask, grammar_rows=[0])
    assert out[0].token_id in allowed
    assert out[1] == free  # the free row samples as it would alone
    if params.logprobs is not None:
        assert out[0].top_token_ids == (int(logits[0].argmax()),)  # from the unmasked logits


# A pattern xgrammar compiles super-linearly (the shape the old maxLength rewrite made): about 28 s on
# the tiny tokenizer here, far past the bounds below.
SLOW = StructuredOutputSpec("json_schema", json.dumps({"type": "string", "pattern": '^[^"]{0,8000}$'}))
QUICK = StructuredOutputSpec("regex", "[ab]{2}-[0-9]")


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def bounded(tokenizer):
    """Compilers with small limits, shut down after the test."""
    made = []

    def make(**limits) -> GrammarCompiler:
        made.append(GrammarCompiler(tokenizer, vocab_size=len(tokenizer), limits=CompileLimits(**limits)))
        return made[-1]

    yield make
    for compiler in made:
        compiler.shutdown()


@pytest.mark.timeout(120)
def test_a_compile_past_the_time_bound_is_refused_and_the_next_one_compiles(bounded):
    compiler = bounded(timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(GrammarError) as refused:
        compiler.matcher(SLOW)
    assert "longer than 1s to compile" in str(refused.value) and "8000" not in str(refused.value)
    assert time.monotonic() - started < 60  # within the bound (and the compile process's start)
    assert compiler._preflight.num_killed == 1
    started = time.monotonic()
    with pytest.raises(GrammarError):  # the same constraint again: refused at once, nothing compiled
        compiler.submit(SLOW).result(timeout=5)
    assert compiler._preflight.num_killed == 1 and time.monotonic() - started < 5
    assert compiler.matcher(QUICK).num_accepted_tokens == 0  # a fresh compile process
    assert compiler.num_pending == 0


@pytest.mark.timeout(120)
def test_pending_compiles_are_bounded_and_a_cached_constraint_never_waits(bounded):
    compiler = bounded(timeout_s=3.0, max_pending=2)
    compiler.matcher(QUICK)  # cached
    slow = compiler.submit(SLOW)
    queued = compiler.submit(StructuredOutputSpec("regex", "[cd]+"))
    with pytest.raises(GrammarBusy):
        compiler.submit(StructuredOutputSpec("regex", "[ef]+"))
    assert compiler.submit(QUICK).done()  # from the cache, at once
    with pytest.raises(GrammarError):
        slow.result(timeout=60)
    assert queued.result(timeout=60).num_accepted_tokens == 0
    assert compiler.num_pending == 0


@pytest.mark.timeout(120)
def test_a_cancelled_queued_compile_is_dropped(bounded):
    compiler = bounded(timeout_s=3.0, max_pending=2)
    slow = compiler.submit(SLOW)
    cancelled_spec = StructuredOutputSpec("regex", "[gh]+")
    queued = compiler.submit(cancelled_spec)
    assert queued.cancel() and compiler.num_pending == 1  # its caller went away: room again at once
    with pytest.raises(GrammarError):
        slow.result(timeout=60)
    assert compiler.num_pending == 0 and compiler.num_cached == 0  # it was never compiled


def test_the_cache_is_bounded_in_bytes(bounded):
    specs = [StructuredOutputSpec("regex", f"x{i}[a-z]{{0,40}}") for i in range(8)]
    size = bounded().matcher(specs[0]).compiled.memory_size_bytes
    limit = 3 * size + 3 * 1024  # room for three of them
    compiler = bounded(cache_bytes=limit)
    for spec in specs:
        compiler.matcher(spec)
    assert 0 < compiler.cache_bytes <= limit and compiler.num_cached == 3  # the most recently used
    assert compiler.submit(specs[-1]).done() and not compiler.submit(specs[0]).done()
    huge = bounded(cache_bytes=1)  # a grammar larger than the whole cache is used, not kept
    assert huge.matcher(QUICK).num_accepted_tokens == 0 and huge.num_cached == 0 and huge.cache_bytes == 0


def test_without_a_compile_process_constraints_are_unavailable(bounded, monkeypatch):
    compiler = bounded()

    def cannot_start(self):
        raise CompileUnavailable

    monkeypatch.setattr(Preflight, "_ensure_started", cannot_start)
    with pytest.raises(GrammarUnavailable):
        compiler.matcher(QUICK)


def test_a_compile_process_that_dies_fails_its_constraint_and_is_replaced(bounded):
    compiler = bounded()
    compiler.matcher(QUICK)
    preflight = compiler._preflight
    connection = preflight._connection
    preflight._process.kill()  # as if xgrammar crashed on the next constraint
    preflight._process.join()
    spec = StructuredOutputSpec("regex", "[ij]+")
    assert preflight._ask(connection, spec, 30) is False and preflight._process is None
    assert compiler.matcher(spec).num_accepted_tokens == 0  # a new process
    assert compiler._preflight.num_started == 2


@pytest.mark.timeout(120)
def test_shutdown_ends_the_compile_under_way_and_nothing_is_compiled_after(bounded):
    compiler = bounded(timeout_s=60.0)
    compiler.matcher(QUICK)  # the compile process is up
    slow, waiting = compiler.submit(SLOW), compiler.submit(StructuredOutputSpec("regex", "[kl]+"))
    _wait_for(lambda: compiler._num_compiling == 1 and len(compiler._queue) == 1)  # the slow one is compiling
    started = time.monotonic()
    compiler.shutdown()
    assert time.monotonic() - started < 30  # not the 60 s bound, nor the compile's minute
    for future in (slow, waiting):
        with pytest.raises(GrammarUnavailable):
            future.result(timeout=5)
    with pytest.raises(GrammarUnavailable):
        compiler.submit(QUICK)


@pytest.mark.parametrize("limits", [{"timeout_s": 0}, {"max_pending": 0}, {"cache_bytes": 0}])
def test_impossible_compile_limits_are_refused(limits):
    with pytest.raises(ValueError):
        CompileLimits(**limits)


def test_failures_after_the_compile_process_quote_nothing(bounded, monkeypatch, caplog):
    """The child compiled it, then this process fails: compiling here, or making the matcher."""
    from services.pd.runner import grammar

    def raises(*args, **kwargs):
        raise RuntimeError(SECRET)

    compiler = bounded()
    monkeypatch.setattr(grammar, "compile_spec", raises)
    with pytest.raises(GrammarError) as here:
        compiler.matcher(StructuredOutputSpec("regex", "[mn]+"))
    monkeypatch.undo()
    monkeypatch.setattr(grammar, "GrammarMatcher", raises)
    with pytest.raises(GrammarError) as matcher:
        compiler.submit(StructuredOutputSpec("regex", "[op]+")).result(timeout=60)
    assert SECRET not in str(here.value) + str(matcher.value) + caplog.text
    assert compiler.num_pending == 0
