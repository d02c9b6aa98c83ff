"""Structured outputs on PD: grammars compiled with xgrammar, one matcher per request, token masks per step.

Why xgrammar (``epd bench grammar``, docs: API, "Structured outputs"): its
per-token mask, the cost every constrained row pays every step, measured
2-17 us on the bench tokenizer against llguidance's 8-119 us, and it compiles
a schema in milliseconds (outlines-core needed seconds for any-JSON). It
imports torch, which is why grammars are compiled here on PD and never in the
proxy.

- ``GrammarCompiler`` turns a ``StructuredOutputSpec`` into a compiled
  grammar, with an LRU cache keyed by the spec, on its own worker thread
  (``submit``), so a slow schema delays the constrained requests behind it,
  never the engine thread and the streams it runs. The tokenizer info covers the LM head's rows: a head wider
  than the tokenizer (``vocab_size``) gets its extra rows masked out.
- ``GrammarMatcher`` is one request's position in its grammar. It implements
  the engine's ``Grammar`` protocol (``accept``, ``is_terminated``) and fills
  its row of a step's bitmask.
- ``BitmaskFiller`` fills the bitmask of a step's constrained rows on a worker
  thread while the forward runs (``ModelRunner.execute``): the matchers only
  change after the step, so their masks are known before the logits are.

xgrammar is the optional ``structured`` extra (``pip install
'epd-cluster[structured]'``): its wheel pulls triton, which an install that
only runs the proxy or encoders never needs. It is imported when first used
(``xgrammar()``); without it PD serves everything else and refuses a
constrained request (``structured_outputs_installed``, the servicer).
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import Any

import torch

from services.pd.engine.request import StructuredOutputSpec

CACHE_ENTRIES = 256  # compiled grammars kept (most recently used); a JSON schema's is kilobytes

STRUCTURED_EXTRA = "structured"
"""The pip extra that installs xgrammar."""

MISSING_EXTRA_MESSAGE = "structured outputs need the 'structured' extra: pip install 'epd-cluster[structured]'"
"""Why a constrained request is refused where xgrammar is not installed (no input in it)."""


def xgrammar() -> ModuleType:
    """The xgrammar module; ImportError where the ``structured`` extra is not installed.

    Imported on use rather than with this module, so that PD, which imports
    this module for every request path, starts without it.
    """
    import xgrammar

    return xgrammar


def structured_outputs_installed() -> bool:
    """Whether xgrammar can be imported here (the ``structured`` extra is installed)."""
    try:
        xgrammar()
    except ImportError:
        return False
    return True


class GrammarError(ValueError):
    """The constraint cannot be compiled. The message is ours and never quotes the constraint."""


class GrammarMatcher:
    """One request's matcher: ``accept`` advances it, ``fill`` writes the tokens allowed next.

    Invariant (``Scheduler.check_integrity``): ``num_accepted_tokens`` equals
    the request's output length. Preemption needs nothing here: a recomputed
    request keeps its output tokens and recomputes only their KV, so the
    matcher's state stays the right one; chunked prefill samples nothing
    before the last chunk, so it never reaches the matcher.
    """

    def __init__(self, compiled: Any) -> None:
        self._matcher = xgrammar().GrammarMatcher(compiled)
        self.num_accepted_tokens = 0

    def accept(self, token_id: int) -> bool:
        """Advances past ``token_id``; False (state unchanged) when the grammar does not allow it."""
        accepted = bool(self._matcher.accept_token(token_id))
        self.num_accepted_tokens += accepted
        return accepted

    @property
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and a stop token was accepted: nothing more may follow."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into ``bitmask [rows, ceil(vocab / 32)]`` int32, row ``row``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and LM head; thread-safe, results cached by spec.

    ``vocab_size`` is the LM head's row count (at least the tokenizer's);
    ``stop_token_ids`` end a complete output (the checkpoint's EOS ids).
    JSON is compiled without free whitespace (``any_whitespace=False``:
    ``", "`` and ``": "`` separators, nothing else between tokens): a model, and above all a random-weight
    one, may otherwise spend its whole ``max_tokens`` on blanks between
    fields. vLLM allows any whitespace by default.
    """

    def __init__(
        self, tokenizer: Any, *, vocab_size: int, stop_token_ids: Sequence[int] = (), max_threads: int = 1
    ) -> None:
        xgr = xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._cache: collections.OrderedDict[StructuredOutputSpec, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def submit(self, spec: StructuredOutputSpec) -> Future[GrammarMatcher]:
        """A new matcher for ``spec``, compiled (or taken from the cache) on the compile thread.

        The future raises ``GrammarError`` for a constraint that cannot be compiled.
        """
        return self._executor.submit(self.matcher, spec)

    def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        """A new matcher for ``spec`` in this thread (``submit`` keeps compiling off the caller's)."""
        return GrammarMatcher(self.compile(spec))

    def compile(self, spec: StructuredOutputSpec) -> Any:
        """The compiled grammar of ``spec``; raises ``GrammarError``."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        try:
            compiled = self._compile(spec)
        except Exception:  # xgrammar raises RuntimeError whose text quotes the input: keep it out
            raise GrammarError("the structured output constraint could not be compiled") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputSpec) -> Any:
        compiler = self._compiler
        if spec.kind == "json_schema":
            schema = bounded_strings_as_patterns(json.loads(spec.value))
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            # One EBNF alternative per choice: JSON string literals are valid EBNF literals (escapes included).
            choices = json.loads(spec.value)
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.value)
        raise GrammarError("unknown constraint kind")

    def shutdown(self) -> None:
        """Stops the compile thread (pending compiles finish first)."""
        self._executor.shutdown(wait=True)


# Data, not subschemas: never rewritten.
_LITERAL_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Characters a JSON string may hold unescaped: no control character (JSON forbids them), no quote or backslash.
_PLAIN_CHARACTER = '[^\\x00-\\x1f"\\\\]'


def bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` with each ``{"type": "string", "minLength"/"maxLength": ...}`` (no pattern or format) as a pattern.

    xgrammar 0.2.8 compiles a length-bounded string to any characters but
    quote, backslash and line breaks, so other control characters, which JSON
    forbids unescaped, get through and the output does not parse. The pattern
    ``^[^\x00-\x1f"\\]{min,max}$`` keeps the bounds with characters that
    need no escape (such a string cannot hold a quote or a backslash). A new
    document; the input is not changed.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _LITERAL_KEYWORDS else bounded_strings_as_patterns(v) for k, v in schema.items()}
    low, high = out.get("minLength", 0), out.get("maxLength")
    if (
        out.get("type") == "string"
        and ("minLength" in out or "maxLength" in out)
        and not ("pattern" in out or "format" in out)
        and isinstance(low, int)
        and isinstance(high, int | None)
    ):
        out.pop("minLength", None), out.pop("maxLength", None)
        out["pattern"] = f"^{_PLAIN_CHARACTER}{{{low},{'' if high is None else high}}}$"
    return out


class BitmaskFiller:
    """Fills a step's token bitmask on one worker thread, overlapping the forward.

    Row ``i`` of the result belongs to ``grammars[i]``; rows without a
    grammar are all ones (everything allowed) and are not applied.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def submit(self, grammars: Sequence[Any]) -> Future[torch.Tensor]:
        """Starts filling ``[len(grammars), ceil(vocab / 32)]`` int32 for the grammars (None = free row)."""
        return self._executor.submit(self.fill, list(grammars))

    def fill(self, grammars: Sequence[Any]) -> torch.Tensor:
        """The bitmask of ``grammars``, in this thread."""
        bitmask = xgrammar().allocate_token_bitmask(len(grammars), self.vocab_size)  # all ones
        for row, grammar in enumerate(grammars):
            if grammar is not None:
                grammar.fill(bitmask, row)
        return bitmask


def apply_bitmask(scores: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``scores [N, vocab]`` with the tokens ``bitmask`` forbids in ``rows`` set to ``-inf`` (a new tensor).

    ``bitmask`` is ``[N, ceil(vocab / 32)]`` on the host; ids past the
    tokenizer's (LM-head padding) are forbidden by it. A copy, because
    ``scores`` may be the logits the logprobs come from.
    """
    masked = scores.clone()
    xgrammar().apply_token_bitmask_inplace(
        masked, bitmask.to(scores.device, non_blocking=True), vocab_size=scores.shape[1], indices=list(rows)
    )
    return masked
