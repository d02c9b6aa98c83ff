"""Structured outputs on PD: grammars compiled with xgrammar, one matcher per request, token masks per step.

Why xgrammar (``epd bench grammar``, docs: API, "Structured outputs"): its
per-token mask, the cost every constrained row pays every step, measured
2-17 us on the bench tokenizer against llguidance's 8-119 us, and it compiles
a schema in milliseconds (outlines-core needed seconds for any-JSON). It
imports torch, which is why grammars are compiled here on PD and never in the
proxy.

- ``GrammarCompiler`` turns a ``StructuredOutputSpec`` into a compiled
  grammar, with an LRU cache keyed by the spec and bounded in bytes, on its
  own worker thread (``submit``), never the engine thread and the streams
  it runs. Each constraint is compiled first in a child process killed past
  a time bound (``grammar_compile.py``), so a slow one is refused and delays
  the constraints behind it by that bound at most; the queue is bounded too.
  The tokenizer info covers the LM head's rows: a head wider than the
  tokenizer (``vocab_size``) gets its extra rows masked out.
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
import hashlib
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from services.pd.engine.request import StructuredOutputSpec
from services.pd.runner.grammar_compile import (
    DEFAULT_CACHE_MB,
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_PENDING_COMPILES,
    CompileOverrun,
    CompileUnavailable,
    Preflight,
    compile_spec,
)

log = logging.getLogger(__name__)


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
        self.compiled = compiled
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


class GrammarBusy(Exception):
    """Too many constraints are waiting to be compiled; retry after ``retry_after_s``."""

    retry_after_s = 1.0


class GrammarUnavailable(Exception):
    """Constraints cannot be compiled here now (the compile process does not start, or PD is stopping)."""


@dataclass(frozen=True)
class CompileLimits:
    """How long one constraint may take to compile, how many may wait, what the compiled ones may keep."""

    timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    max_pending: int = DEFAULT_MAX_PENDING_COMPILES
    cache_bytes: int = DEFAULT_CACHE_MB << 20

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and self.max_pending > 0 and self.cache_bytes > 0):
            raise ValueError("the grammar compile timeout, pending bound and cache size must be positive")


@dataclass
class _Job:
    spec: StructuredOutputSpec
    future: Future[GrammarMatcher]


class GrammarCompiler:
    """Compiles constraints for one tokenizer and LM head; thread-safe, results cached by spec.

    ``vocab_size`` is the LM head's row count (at least the tokenizer's);
    ``stop_token_ids`` end a complete output (the checkpoint's EOS ids).
    JSON is compiled without free whitespace (``any_whitespace=False``:
    ``", "`` and ``": "`` separators, nothing else between tokens): a model, and above all a random-weight
    one, may otherwise spend its whole ``max_tokens`` on blanks between
    fields. vLLM allows any whitespace by default.

    Bounded (``CompileLimits``): each constraint is compiled first in a child
    process (``grammar_compile.Preflight``) that is killed past
    ``timeout_s`` (the constraint is then refused, ``GrammarError``, and
    refused again at once if it comes back); at most ``max_pending``
    constraints wait for (or are in) a compile (more: ``GrammarBusy``); a
    queued compile whose caller went away (its future cancelled) is dropped;
    the compiled grammars kept are bounded in bytes (``memory_size_bytes``
    plus the constraint's text), least recently used first out, and one
    larger than the whole cache is used by its request and not kept. A
    cached constraint is answered at once, never behind a compile.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        stop_token_ids: Sequence[int] = (),
        max_threads: int = 1,
        limits: CompileLimits | None = None,
    ) -> None:
        xgr = xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self.vocab_size = vocab_size
        self.limits = limits or CompileLimits()
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._preflight = Preflight(info.serialize_json())
        self._cache: collections.OrderedDict[StructuredOutputSpec, tuple[Any, int]] = collections.OrderedDict()
        self.cache_bytes = 0  # what the cached grammars hold, by ``_entry_bytes``
        self._overran: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # digests of specs
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._num_compiling = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def num_pending(self) -> int:
        """Constraints waiting for a compile or being compiled."""
        with self._cond:
            return len(self._queue) + self._num_compiling

    @property
    def num_cached(self) -> int:
        with self._cond:
            return len(self._cache)

    def submit(self, spec: StructuredOutputSpec) -> Future[GrammarMatcher]:
        """A new matcher for ``spec``: at once from the cache, else compiled on the compile thread.

        The future raises ``GrammarError`` for a constraint that cannot be compiled (or overran the
        time bound), ``GrammarUnavailable`` when nothing can be compiled; cancelling it while it waits
        drops its compile. Raises ``GrammarBusy`` when ``max_pending`` constraints wait already, and
        ``GrammarUnavailable`` once shut down.
        """
        future: Future[GrammarMatcher] = Future()
        with self._cond:
            if self._closed:
                raise GrammarUnavailable("structured outputs are not served while this server stops")
            cached = self._cache_get(spec)
            if cached is None and _digest(spec) in self._overran:
                future.set_exception(GrammarError(self._overrun_message()))
                return future
            if cached is None:
                if len(self._queue) + self._num_compiling >= self.limits.max_pending:
                    raise GrammarBusy("too many structured output constraints are waiting to be compiled")
                self._queue.append(_Job(spec, future))
                self._start_thread()
                self._cond.notify()
        if cached is not None:
            future.set_result(GrammarMatcher(cached))
            return future
        future.add_done_callback(self._forget_if_cancelled)
        return future

    def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        """A new matcher for ``spec``, waiting for its compile (``submit``'s errors)."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        """Stops the compile thread and process; what still waits fails with ``GrammarUnavailable``."""
        with self._cond:
            self._closed = True
            left, self._queue = list(self._queue), collections.deque()
            self._cond.notify_all()
            thread = self._thread
        for job in left:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(GrammarUnavailable("this server is stopping"))
        self._preflight.interrupt()  # a compile under way ends now, not at its bound
        if thread is not None:
            thread.join()
        self._preflight.stop()

    # ------------------------------------------------------------ the compile thread
    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="grammar-compile", daemon=True)
            self._thread.start()

    def _forget_if_cancelled(self, future: Future[GrammarMatcher]) -> None:
        if future.cancelled():
            with self._cond:
                self._queue = collections.deque(job for job in self._queue if job.future is not future)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue  # cancelled as it was taken
                self._num_compiling += 1
            try:
                job.future.set_result(GrammarMatcher(self._compiled(job.spec)))
            except (GrammarError, GrammarUnavailable) as error:
                job.future.set_exception(error)
            except Exception as error:  # its text could quote the constraint: the type only, here and there
                log.error("compiling a structured output constraint failed: %s", type(error).__name__)
                job.future.set_exception(GrammarError(_DID_NOT_COMPILE))
            finally:
                with self._cond:
                    self._num_compiling -= 1

    def _compiled(self, spec: StructuredOutputSpec) -> Any:
        """The compiled grammar of ``spec``: from the cache, else compiled by the child first (bounded in
        time), then here; raises ``GrammarError`` / ``GrammarUnavailable``."""
        with self._cond:
            cached = self._cache_get(spec)  # an earlier job may have compiled it
        if cached is not None:
            return cached
        if self._closed:
            raise GrammarUnavailable("this server is stopping")
        try:
            compiles = self._preflight.check(spec, self.limits.timeout_s)
        except CompileOverrun:
            with self._cond:
                self._overran[_digest(spec)] = None
                while len(self._overran) > _OVERRAN_MEMORY:
                    self._overran.popitem(last=False)
            log.warning("a structured output constraint took over %gs to compile: refused", self.limits.timeout_s)
            raise GrammarError(self._overrun_message()) from None
        except CompileUnavailable:
            raise GrammarUnavailable("the grammar compile process could not be started") from None
        if self._closed:
            raise GrammarUnavailable("this server is stopping")
        if not compiles:
            raise GrammarError(_DID_NOT_COMPILE)
        try:
            compiled = compile_spec(xgrammar(), self._compiler, spec)
        except Exception:  # xgrammar raises RuntimeError whose text quotes the input: keep it out
            raise GrammarError(_DID_NOT_COMPILE) from None
        self._cache_put(spec, compiled)
        return compiled

    def _overrun_message(self) -> str:
        return f"the structured output constraint takes longer than {self.limits.timeout_s:g}s to compile"

    # ------------------------------------------------------------ the cache
    def _cache_get(self, spec: StructuredOutputSpec) -> Any | None:
        """The cached grammar of ``spec`` (None: not cached), now the most recently used; under ``_cond``."""
        entry = self._cache.get(spec)
        if entry is None:
            return None
        self._cache.move_to_end(spec)
        return entry[0]

    def _cache_put(self, spec: StructuredOutputSpec, compiled: Any) -> None:
        size = _entry_bytes(spec, compiled)
        if size > self.limits.cache_bytes:
            return  # its request holds it; the cache keeps the others
        with self._cond:
            if spec in self._cache:
                return
            self._cache[spec] = (compiled, size)
            self.cache_bytes += size
            while self.cache_bytes > self.limits.cache_bytes:
                _, (_, evicted) = self._cache.popitem(last=False)
                self.cache_bytes -= evicted


_DID_NOT_COMPILE = "the structured output constraint could not be compiled"
_OVERRAN_MEMORY = 1024  # constraints that overran, refused at once when they come back (their digests)


def _digest(spec: StructuredOutputSpec) -> bytes:
    return hashlib.sha256(f"{spec.kind}\0{spec.value}".encode()).digest()


def _entry_bytes(spec: StructuredOutputSpec, compiled: Any) -> int:
    """What a cached grammar holds: xgrammar's estimate of the compiled grammar, and the constraint's text."""
    return int(compiled.memory_size_bytes) + len(spec.value.encode()) + 256


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
