"""``FaultyRunner`` (``epd pd --fault``): what it does not fault is the wrapped runner's.

A prefill PD started with a fault must still push its KV (``read_kv_blocks``),
and a decode PD must still take one (``kv_push_shape``, ``dtype``,
``write_kv_blocks``): the wrapper once hid them (AttributeError on P's push).
"""

from __future__ import annotations

import copy

from services.pd.faults import FaultyRunner, PdFaults


class _Runner:
    dtype = "float32"

    def __init__(self) -> None:
        self.written: list[tuple[list[int], str]] = []

    def execute(self, scheduler_output, embeddings=None):
        return ("ran", scheduler_output)

    def read_kv_blocks(self, block_ids):
        return f"kv of {list(block_ids)}"

    def write_kv_blocks(self, block_ids, kv):
        self.written.append((list(block_ids), kv))

    def kv_push_shape(self, num_blocks):
        return (2, 1, 1, num_blocks, 16, 8)


def test_the_kv_hand_off_reaches_the_wrapped_runner() -> None:
    inner = _Runner()
    runner = FaultyRunner(inner, PdFaults(forward_raises_after=5))
    assert runner.read_kv_blocks([3, 4]) == "kv of [3, 4]"
    runner.write_kv_blocks([7], "kv")
    assert inner.written == [([7], "kv")]
    assert runner.kv_push_shape(2) == (2, 1, 1, 2, 16, 8) and runner.dtype == "float32"
    assert runner.execute("batch") == ("ran", "batch") and runner.num_steps == 1  # still counted


def test_a_missing_attribute_is_still_an_attribute_error() -> None:
    runner = FaultyRunner(_Runner(), PdFaults(freeze_step_ms=1))
    assert not hasattr(runner, "no_such_method")
    assert copy.copy(runner).read_kv_blocks([1]) == "kv of [1]"  # a copy under construction does not recurse


def test_drop_deepstack_zeroes_every_received_embeddings_features_and_nothing_else() -> None:
    import torch

    class _Preparing(_Runner):
        def prepare_embedding(self, embedding):
            return embedding.clone()

    faults = PdFaults.parse("drop-deepstack")
    assert faults.drop_deepstack and faults.enabled and faults.describe() == "drop-deepstack"
    runner = FaultyRunner(_Preparing(), faults)
    with_features = torch.ones(4, 4, 8)  # [tokens, 1 + 3 levels, hidden]
    prepared = runner.prepare_embedding(with_features)
    assert torch.equal(prepared[:, 0], with_features[:, 0]) and not prepared[:, 1:].any()
    assert with_features.all()  # the received tensor is not written to
    plain = torch.ones(4, 8)  # a model without DeepStack features: unchanged
    assert torch.equal(runner.prepare_embedding(plain), plain)
