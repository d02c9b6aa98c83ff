"""``EngineStats``: what the engine core reports about itself, in one frozen value.

Built by ``EngineCore.stats()`` on the engine thread; read by metrics, load
reports, drain and leak checks. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.pd.engine.step_budget import BudgetSnapshot
from services.pd.engine.step_stats import StepSnapshot


@dataclass(frozen=True)
class EngineStats:
    """Gauges and counters of one engine core at one moment between two steps."""

    # requests
    num_running: int  # holding KV blocks (prefilling or decoding)
    num_waiting: int  # queued for admission, preempted ones included
    num_live_requests: int  # admitted by Generate and not ended
    # KV cache
    num_kv_blocks_total: int
    num_kv_blocks_used: int  # referenced by block tables or pins
    num_kv_blocks_pinned: int  # references held by pins (cached prefixes not admitted yet)
    num_kv_leases: int  # Preallocate leases whose pinned KV answered an item READY
    num_prefix_hit_tokens: int  # prompt tokens served by the prefix cache, all admissions
    num_preemptions: int
    # embedding cache (rows = tokens)
    capacity_tokens: int
    used_tokens: int
    reserved_tokens: int  # waiting for a push
    ready_tokens: int
    evictable_tokens: int  # ready, unreferenced and unreserved
    num_entries: int
    num_reservations: int
    num_embeddings_stored: int  # tensors held (one per READY entry)
    num_expired_leases: int  # leases that ran out unused: per image reservation, per KV lease
    # steps
    steps: StepSnapshot
    budget: BudgetSnapshot  # the step budget controller (step_budget.py)
    # KV hand-off (kv_handoff.py)
    num_kv_reservations: int = 0  # decode side: live reservations waiting for a push or their Generate
    num_kv_exports: int = 0  # prefill side: finished prefills whose K/V is held for a push
    num_expired_kv_reservations: int = 0  # reservations whose lease ran out
    # Uncached tokens of the requests running / waiting: prompt tokens not served by the prefix cache, plus
    # output tokens so far (the cache-aware routing's load, ``EngineCore.stats``)
    num_running_tokens: int = 0
    num_waiting_tokens: int = 0

    @property
    def referenced_tokens(self) -> int:
        """READY rows that cannot be evicted: referenced by a request or pinned by a reservation."""
        return self.ready_tokens - self.evictable_tokens

    @property
    def num_steps(self) -> int:
        return self.steps.num_steps

    @property
    def is_idle(self) -> bool:
        """Nothing admitted, queued, reserved or pinned: a drain is complete."""
        return not (
            self.num_live_requests
            or self.num_reservations
            or self.num_kv_leases
            or self.referenced_tokens
            or self.num_kv_reservations
            or self.num_kv_exports
        )
