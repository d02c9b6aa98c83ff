"""The grammar side of the runner: compiling each constraint (cached, errors that quote nothing), matchers,
masks for an LM head wider than the tokenizer, and the sampler obeying them, greedy and random."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from services.pd.engine.request import SamplingParams, StructuredOutputSpec
from services.pd.runner.grammar import (
    BitmaskFiller,
    GrammarCompiler,
    GrammarError,
    apply_bitmask,
    bounded_strings_as_patterns,
)
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
    assert compiler.compile(spec) is compiler.compile(StructuredOutputSpec("regex", "[xyz]+"))
    first, second = compiler.submit(spec).result(), compiler.submit(spec).result()
    assert first is not second and first.num_accepted_tokens == second.num_accepted_tokens == 0


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


def test_bounded_strings_become_patterns_that_keep_json_valid():
    schema = {
        "type": "object",
        "properties": {
            "short": {"type": "string", "minLength": 1, "maxLength": 3},
            "open": {"type": "string", "minLength": 2},
            "patterned": {"type": "string", "maxLength": 3, "pattern": "^a+$"},
            "odd": {"type": "string", "maxLength": "3"},
        },
        "enum": [{"type": "string", "maxLength": 1}],
    }
    out = bounded_strings_as_patterns(schema)
    properties = out["properties"]
    assert properties["short"] == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{1,3}$'}
    assert properties["open"] == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{2,}$'}
    assert properties["patterned"] == schema["properties"]["patterned"]  # its own pattern wins
    assert properties["odd"] == schema["properties"]["odd"]  # not a length xgrammar could take anyway
    assert out["enum"] == schema["enum"]  # data, not a schema
    assert schema["properties"]["short"] == {"type": "string", "minLength": 1, "maxLength": 3}  # input unchanged


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
