"""Grammar libraries for structured outputs side by side on CPU: compile time and per-token mask time.

For each JSON schema of ``SCHEMAS`` (and any-JSON, ``json_object``) and each
library installed (``xgrammar``, which PD uses; ``llguidance`` and
``outlines-core`` when ``pip install llguidance outlines-core`` added them),
on the tokenizer of ``--model``:

- ``compile ms``: schema to something that can mask tokens, with a cold cache
  (xgrammar: ``GrammarCompiler.compile_json_schema``; llguidance: building the
  ``LLMatcher``, whose work is lazy; outlines-core: schema -> regex -> ``Index``,
  the whole automaton built up front);
- ``mask us``: mean time to compute one next-token mask (a bitmask over the
  vocabulary) along a seeded walk that takes a random allowed token each step,
  ``--steps`` tokens per walk (ended early when the grammar completes).

One thread; the libraries see the same schemas, tokenizer and walk seeds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

SCHEMAS: dict[str, dict[str, Any] | None] = {
    "json_object": None,  # any JSON object
    "enum+bool": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "nested+arrays": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "tags", "point"],
        "additionalProperties": False,
    },
    "20 fields": {
        "type": "object",
        "properties": {f"field_{i}": {"type": ["integer", "string", "boolean"][i % 3]} for i in range(20)},
        "required": [f"field_{i}" for i in range(20)],
        "additionalProperties": False,
    },
}

LIBRARIES = ("xgrammar", "llguidance", "outlines_core")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bench", help="checkpoint dir or preset whose tokenizer is used")
    parser.add_argument("--steps", type=int, default=64, help="tokens per mask walk (default: 64)")
    parser.add_argument("--walks", type=int, default=3, help="seeded walks per schema (default: 3)")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from services.common.models import ensure_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model(args.model)))
    rows = []
    for library in LIBRARIES:
        if importlib.util.find_spec(library) is None:
            print(f"{library}: not installed, skipped")
            continue
        make = _BACKENDS[library](tokenizer)
        for name, schema in SCHEMAS.items():
            compile_ms, mask_us, num_masks = _measure(make, schema, args.steps, args.walks)
            rows.append((library, name, compile_ms, mask_us, num_masks))
    print("| library | schema | compile ms | mask us/token | masks timed |\n|---|---|---|---|---|")
    for library, name, compile_ms, mask_us, num_masks in rows:
        print(f"| {library} | {name} | {compile_ms:.1f} | {mask_us:.0f} | {num_masks} |")
    return 0


# A backend: schema -> (compile seconds, new walker). A walker is (fill, allowed, accept): fill() computes the
# next mask (the timed part; False when the grammar is done), allowed() reads its ids, accept(id) advances.
Walker = tuple[Callable[[], bool], Callable[[], list[int]], Callable[[int], None]]


def _measure(make, schema, steps: int, walks: int) -> tuple[float, float, int]:
    compile_s, new_walker = make(schema)
    mask_times = []
    for seed in range(walks):
        rng = random.Random(seed)
        fill, allowed_ids, accept = new_walker()
        for _ in range(steps):
            start = time.perf_counter()
            more = fill()
            mask_times.append(time.perf_counter() - start)
            allowed = allowed_ids() if more else []
            if not allowed:
                break
            accept(rng.choice(allowed))
    return compile_s * 1e3, statistics.mean(mask_times) * 1e6, len(mask_times)


def _schema_text(schema) -> str:
    return json.dumps(schema if schema is not None else {"type": "object"})


def _xgrammar(tokenizer):
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))

    def make(schema):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        start = time.perf_counter()
        if schema is None:
            compiled = compiler.compile_builtin_json_grammar()
        else:
            compiled = compiler.compile_json_schema(_schema_text(schema))
        elapsed = time.perf_counter() - start

        def walker():
            matcher = xgr.GrammarMatcher(compiled)
            bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

            def fill():
                if matcher.is_terminated():
                    return False
                matcher.fill_next_token_bitmask(bitmask)  # returns whether the mask excludes anything
                return True

            return fill, lambda: _bits(bitmask[0], info.vocab_size, torch), matcher.accept_token

        return elapsed, walker

    return make


def _llguidance(tokenizer):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp
    import torch

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def make(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_schema_text(schema))
        start = time.perf_counter()
        llguidance.LLMatcher(ll_tokenizer, grammar)
        elapsed = time.perf_counter() - start

        def walker():
            matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
            bitmask = lnp.allocate_token_bitmask(1, len(tokenizer))

            def fill():
                if matcher.is_stopped():
                    return False
                lnp.fill_next_token_bitmask(matcher, bitmask, 0)
                return True

            return fill, lambda: _bits(torch.from_numpy(bitmask[0]), len(tokenizer), torch), matcher.consume_token

        return elapsed, walker

    return make


def _outlines_core(tokenizer):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    decoder = {v: k for k, v in _bytes_to_unicode().items()}
    by_bytes: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id != tokenizer.eos_token_id and token not in tokenizer.all_special_tokens:
            by_bytes.setdefault(bytes(decoder[c] for c in token if c in decoder), []).append(token_id)
    vocabulary = Vocabulary(tokenizer.eos_token_id, by_bytes)

    def make(schema):
        start = time.perf_counter()
        index = Index(build_regex_from_schema(_schema_text(schema)), vocabulary)
        elapsed = time.perf_counter() - start

        def walker():
            guide = Guide(index)

            tokens: list[int] = []

            def fill():
                # get_tokens() is outlines-core's mask: the allowed ids of the automaton's state.
                tokens[:] = [] if guide.is_finished() else guide.get_tokens()
                return bool(tokens)

            return fill, lambda: [t for t in tokens if t != tokenizer.eos_token_id], guide.advance

        return elapsed, walker

    return make


def _bits(row, vocab_size: int, torch) -> list[int]:
    """Allowed ids of one int32 bitmask row (bit ``i % 32`` of word ``i // 32``)."""
    ids = torch.arange(vocab_size)
    words = row[ids // 32]
    return ids[((words >> (ids % 32)) & 1).bool()].tolist()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE tokens are spelled with it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


_BACKENDS = {"xgrammar": _xgrammar, "llguidance": _llguidance, "outlines_core": _outlines_core}
