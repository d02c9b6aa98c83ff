"""Test-only fault injection for the PD step loop (``epd pd --fault ...``).

Off unless a fault is named. Each fault makes the model runner misbehave once,
so that tests and soak runs drive the engine's real failure branches against
real servers. Steps are counted from the moment the faults are installed,
which is after warm-up: step 0 is the first step that serves a client.

- ``forward-raises-after=N``  the forward of step N raises (after N good steps). The engine must fail
                              the requests of that batch with INTERNAL, free their KV blocks and
                              embedding references, and keep serving.
- ``freeze-step-ms=M``        step ``freeze-after`` (default 0) stalls M ms before its forward: the
                              readiness watchdog must report NOT_SERVING (with ``--stall-timeout-s``
                              < M/1000) and SERVING again once the step completes.
- ``freeze-after=N``          which step freezes (needs ``freeze-step-ms``).
- ``drop-deepstack``          every image embedding this PD receives loses its DeepStack features (set
                              to zero, which adds nothing): the LM runs on the embedding rows alone, so
                              a Qwen3-VL answer must then differ from ``generate()``'s (the test that
                              shows the features are carried and used).

Each step fault fires once per process. Several combine with commas
(``forward-raises-after=20,freeze-step-ms=5000``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common.fault_spec import parse_fault_spec

log = logging.getLogger(__name__)

_SWITCHES = {"drop-deepstack": "drop_deepstack"}
_INT_FIELDS = {
    "forward-raises-after": "forward_raises_after",
    "freeze-step-ms": "freeze_step_ms",
    "freeze-after": "freeze_after",
}


class InjectedFault(RuntimeError):
    """What the ``forward-raises-after`` fault raises in place of a model forward."""


@dataclass(frozen=True)
class PdFaults:
    """Which faults the model runner injects; the default injects none."""

    forward_raises_after: int | None = None  # index of the step whose forward raises
    freeze_step_ms: int = 0  # how long the frozen step stalls (0 = no freeze)
    freeze_after: int | None = None  # index of the step that freezes (None = 0)
    drop_deepstack: bool = False  # zero the DeepStack rows of every embedding received

    def __post_init__(self) -> None:
        for name in ("forward_raises_after", "freeze_after"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0")
        if self.freeze_step_ms < 0:
            raise ValueError("freeze-step-ms must be >= 0")
        if self.freeze_after is not None and not self.freeze_step_ms:
            raise ValueError("freeze-after needs freeze-step-ms=M (how long the step stalls)")

    @classmethod
    def parse(cls, spec: str) -> PdFaults:
        """``"forward-raises-after=3,freeze-step-ms=500"`` -> ``PdFaults``; ValueError names the bad part."""
        return cls(**parse_fault_spec(spec, switches=_SWITCHES, integers=_INT_FIELDS))

    @property
    def enabled(self) -> bool:
        return self != PdFaults()

    def describe(self) -> str:
        """The spec string these faults parse from (for the start-up warning)."""
        parts = []
        if self.forward_raises_after is not None:
            parts.append(f"forward-raises-after={self.forward_raises_after}")
        if self.freeze_step_ms:
            parts.append(f"freeze-step-ms={self.freeze_step_ms}")
        if self.freeze_after is not None:
            parts.append(f"freeze-after={self.freeze_after}")
        if self.drop_deepstack:
            parts.append("drop-deepstack")
        return ",".join(parts)


NO_FAULTS = PdFaults()


class FaultyRunner:
    """Wraps the engine's model runner and injects ``faults`` into its steps.

    The engine core calls ``execute`` and ``prepare_embedding``, always on the
    engine thread; any other attribute is the wrapped runner's. ``thaw`` may be
    called from any thread to end a freeze early (tests).
    """

    def __init__(self, runner: Any, faults: PdFaults) -> None:
        self.inner = runner
        self.faults = faults
        self.num_steps = 0  # forwards attempted since installation
        self.num_injected = 0  # faults that fired
        self._thawed = threading.Event()

    def execute(self, scheduler_output: Any, embeddings: Mapping[str, Any] | None = None) -> Any:
        step, self.num_steps = self.num_steps, self.num_steps + 1
        faults = self.faults
        if faults.freeze_step_ms and step == (faults.freeze_after or 0):
            self.num_injected += 1
            log.warning("FAULT: step %d freezes for %d ms", step, faults.freeze_step_ms)
            self._thawed.wait(faults.freeze_step_ms / 1000.0)
        if step == faults.forward_raises_after:
            self.num_injected += 1
            log.warning("FAULT: the forward of step %d raises", step)
            raise InjectedFault(f"injected fault: forward of step {step} raised")
        return self.inner.execute(scheduler_output, embeddings)

    def prepare_embedding(self, embedding: Any) -> Any:
        prepared = self.inner.prepare_embedding(embedding)
        if self.faults.drop_deepstack and prepared.dim() == 3:
            prepared = prepared.clone()
            prepared[:, 1:] = 0  # added to the hidden states, zero rows change nothing
        return prepared

    def __getattr__(self, name: str) -> Any:
        """Everything not faulted is the wrapped runner's: the KV hand-off's ``read_kv_blocks``,
        ``write_kv_blocks``, ``kv_push_shape`` and ``dtype`` (a faulty prefill PD still pushes)."""
        if name == "inner":  # not set yet (a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def thaw(self) -> None:
        """Ends a freeze in progress (and cancels one still to come)."""
        self._thawed.set()


def install(core: Any, faults: PdFaults) -> FaultyRunner:
    """Wraps ``core.runner``; call it on the engine thread (``await bridge.call(install, bridge.core, faults)``)."""
    runner = FaultyRunner(core.runner, faults)
    core.runner = runner
    return runner
