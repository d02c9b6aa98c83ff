"""Compiling one constraint with xgrammar, and the child process that tries each one first, under a time bound.

``compile_spec`` turns a ``StructuredOutputSpec`` into xgrammar's compiled
grammar. A JSON schema's length-bounded strings (``minLength`` /
``maxLength``) keep xgrammar's own bounded repetition, whose compile time
stays flat in the bound (``maxLength`` 9000: about 0.2 s on the bench's
8k-token vocabulary), with the character class JSON allows: xgrammar 0.2.8
lets control characters (other than line breaks) into such a string, and the
output then does not parse (``json_safe_strings``). They were rewritten into
a ``pattern`` before, a bounded regex repetition that xgrammar compiles
super-linearly (``maxLength`` 4000: 24-47 s, 9000: over 200 s).

xgrammar's compile is C++ and cannot be interrupted in a thread, and other
inputs stay slow (a regex or grammar with a large bounded repetition), so
each constraint is compiled first in a child process (``Preflight``), which
is killed when it overruns the time bound: the constraint is refused, the
CPU is given back, and the next constraint gets a fresh child. Only one that
compiled in time is then compiled where it is used (a compiled grammar does
not cross processes cheaply: xgrammar's JSON serialization of a 0.8 MB
grammar takes longer than compiling it). The child is forked from
multiprocessing's fork server, which imports xgrammar once, so a new child
starts in tens of milliseconds; the first one waits for the fork server
(seconds: it imports torch and xgrammar).
"""

from __future__ import annotations

import json
import multiprocessing
import re
import threading
from multiprocessing.connection import Connection
from typing import Any

from services.pd.engine.request import StructuredOutputSpec

DEFAULT_COMPILE_TIMEOUT_S = 5.0
"""How long one constraint may take to compile (``--grammar-compile-timeout-s``); longer: refused."""
DEFAULT_MAX_PENDING_COMPILES = 32
"""Constraints waiting for a compile or in one (``--max-pending-grammar-compiles``); more: RESOURCE_EXHAUSTED."""
DEFAULT_CACHE_MB = 256
"""What the compiled grammars kept may hold, MiB (``--grammar-cache-mb``)."""

_START_TIMEOUT_S = 300.0  # the fork server's first start imports torch and xgrammar; a busy host is slow
_PRELOAD = ["xgrammar", "services.pd.runner.grammar_compile"]

# A rule xgrammar 0.2.8 writes for the characters of a length-bounded JSON string: anything but a quote, a
# backslash and line breaks. Its body is written for nothing else in a JSON schema's grammar.
_BOUNDED_CHARACTERS = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
# What JSON allows unescaped in a string: no control character, quote or backslash.
_JSON_CHARACTERS = r"(([^\0-\x1f\"\\]))"


class CompileOverrun(Exception):
    """The constraint did not compile within the time bound (its child process was killed)."""


class CompileUnavailable(Exception):
    """The compile process could not be started."""


def json_safe_strings(ebnf: str) -> str:
    """``ebnf`` (xgrammar's grammar of a JSON schema) with the characters of each length-bounded string
    limited to those JSON allows unescaped; the bounds stay xgrammar's own repetition."""
    return _BOUNDED_CHARACTERS.sub(lambda match: f"{match.group(1)} ::= {_JSON_CHARACTERS}", ebnf)


def compile_spec(xgr: Any, compiler: Any, spec: StructuredOutputSpec) -> Any:
    """xgrammar's compiled grammar of ``spec``; raises whatever xgrammar raises (its text may quote input).

    JSON is compiled without free whitespace (``any_whitespace=False``, see ``GrammarCompiler``)."""
    if spec.kind == "json_schema":
        ebnf = str(xgr.Grammar.from_json_schema(spec.value, any_whitespace=False))
        safe = json_safe_strings(ebnf)
        if safe != ebnf:
            return compiler.compile_grammar(safe)
        return compiler.compile_json_schema(spec.value, any_whitespace=False)
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
    raise ValueError("unknown constraint kind")


def _child_main(connection: Connection, tokenizer_info_json: str) -> None:
    """The child process: compiles each ``(kind, value)`` it is sent, answers ``True`` (it compiled) or
    ``False``; nothing else (the compiled grammar stays here)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    connection.send(True)  # ready
    while True:
        try:
            kind, value = connection.recv()
        except (EOFError, OSError):
            return
        try:
            compile_spec(xgr, compiler, StructuredOutputSpec(kind, value))
        except Exception:
            connection.send(False)
        else:
            connection.send(True)


class Preflight:
    """One child process that compiles constraints first, killed when one overruns; used by one thread.

    ``check(spec, timeout_s)``: True when ``spec`` compiled in time, False when it does not compile
    (or the child died on it); raises ``CompileOverrun`` past the bound, ``CompileUnavailable`` when no
    child can be started. A child is started on first use and after each kill."""

    _preload_lock = threading.Lock()

    def __init__(self, tokenizer_info_json: str) -> None:
        self._tokenizer_info_json = tokenizer_info_json
        self._process: Any = None
        self._connection: Connection | None = None
        self.num_started = 0
        self.num_killed = 0
        self._shut = False  # by ``interrupt``: no child is started again

    def check(self, spec: StructuredOutputSpec, timeout_s: float) -> bool:
        return self._ask(self._ensure_started(), spec, timeout_s)

    def _ask(self, connection: Connection, spec: StructuredOutputSpec, timeout_s: float) -> bool:
        try:
            connection.send((spec.kind, spec.value))
            if not connection.poll(timeout_s):
                self.stop()
                self.num_killed += 1
                raise CompileOverrun
            return bool(connection.recv())
        except (EOFError, OSError, BrokenPipeError):
            self.stop()  # it died on this constraint: the next one gets a fresh child
            return False

    def _ensure_started(self) -> Connection:
        if self._connection is not None and self._process is not None and self._process.is_alive():
            return self._connection
        self.stop()
        if self._shut:
            raise CompileUnavailable
        context = multiprocessing.get_context("forkserver")
        with Preflight._preload_lock:  # once the fork server runs, this changes nothing
            context.set_forkserver_preload(_PRELOAD)
        ours, theirs = context.Pipe()
        process = context.Process(
            target=_child_main, args=(theirs, self._tokenizer_info_json), name="grammar-compile", daemon=True
        )
        try:
            process.start()
        except OSError:
            ours.close()
            theirs.close()
            raise CompileUnavailable from None
        theirs.close()
        self._process, self._connection = process, ours
        if self._shut:  # interrupted while it started
            self.stop()
            raise CompileUnavailable
        try:
            ready = ours.poll(_START_TIMEOUT_S) and ours.recv()
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.stop()
            raise CompileUnavailable
        self.num_started += 1
        return ours

    def interrupt(self) -> None:
        """Stops for good, from another thread: kills the child; the thread using it sees it gone
        (``check`` answers False, or raises ``CompileUnavailable``: no child is started again) and cleans up."""
        self._shut = True
        process = self._process
        if process is not None:
            try:
                process.kill()
            except (ValueError, OSError):  # closed or gone meanwhile
                pass

    def stop(self) -> None:
        """Kills the child (if any); by the thread that uses it. Idempotent."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(10)
            try:
                process.close()
            except ValueError:  # still running after SIGKILL and 10 s: left to the interpreter's exit
                pass
