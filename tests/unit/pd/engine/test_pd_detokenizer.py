"""IncrementalDetokenizer with a real byte-level BPE tokenizer (trained in-test, tiny vocab), and its options."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from services.pd.engine.detokenizer import IncrementalDetokenizer
from services.pd.engine.outputs import SampledToken
from services.pd.engine.request import Request, RequestStatus, SamplingParams
from services.pd.engine.streams import RequestStreams

TEXTS = [
    "Hello world, this is plain ASCII.",
    "héllo wörld café naïve",
    "日本語のテキストです",
    "emoji 🎉🚀 party 👩‍👩‍👧 family",
    "mixed: Ünïcödé → ∑ 🧪 done",
]
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE small enough that multi-byte characters split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(detok: IncrementalDetokenizer, token_ids: list[int], group_sizes=(1,)) -> tuple[list[str], bool]:
    """Feed tokens in groups (cycling through ``group_sizes``); return the deltas and the final stop flag."""
    deltas, i, k, stopped = [], 0, 0, False
    while i < len(token_ids):
        n = group_sizes[k % len(group_sizes)]
        text, stopped = detok.add_tokens(token_ids[i : i + n])
        deltas.append(text)
        i, k = i + n, k + 1
    deltas.append(detok.flush())
    return deltas, stopped


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("group_sizes", [(1,), (2, 3, 1)])
def test_stream_equals_decode_and_never_splits_characters(tokenizer, text, group_sizes):
    ids = _encode(tokenizer, text)
    deltas, stopped = _stream(IncrementalDetokenizer(tokenizer, PROMPT), ids, group_sizes)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)
    assert not stopped


def test_multibyte_characters_really_span_tokens(tokenizer):
    # Guards the test above: with this vocab, single tokens decode to U+FFFD.
    ids = _encode(tokenizer, "🚀🧪")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_random_token_streams_equal_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        deltas, _ = _stream(IncrementalDetokenizer(tokenizer, PROMPT), ids, (1, 2))
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = _encode(tokenizer, "ab") + [tokenizer.eos_token_id] + _encode(tokenizer, "cd")
    skipped, _ = _stream(IncrementalDetokenizer(tokenizer, PROMPT), ids)
    kept, _ = _stream(IncrementalDetokenizer(tokenizer, PROMPT, skip_special_tokens=False), ids)
    assert "".join(skipped) == "abcd"
    assert "".join(kept) == "ab</s>cd"


def test_trailing_incomplete_character_is_released_by_flush(tokenizer):
    ids = _encode(tokenizer, "ok 🚀")[:-1]  # drop the rocket's last byte token
    detok = IncrementalDetokenizer(tokenizer, PROMPT)
    text, _ = detok.add_tokens(ids)
    assert "\ufffd" not in text
    assert text + detok.flush() == tokenizer.decode(ids)


def test_stop_string_spanning_tokens_cuts_the_text(tokenizer):
    text = "emoji 🎉🚀 party"
    stop = "🎉🚀"
    ids = _encode(tokenizer, text)
    boundaries = {len(tokenizer.decode(ids[:i]).encode()) for i in range(len(ids))}
    start = len(text[: text.index(stop)].encode())
    assert any(start < b < start + len(stop.encode()) for b in boundaries)  # really spans tokens
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["zzz", stop])
    deltas, stopped = _stream(detok, ids)
    assert stopped and detok.stopped
    assert "".join(deltas) == "emoji "
    assert detok.add_tokens(_encode(tokenizer, "more")) == ("", True)
    assert detok.flush() == ""


def test_stop_prefix_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["stop here"])
    first, stopped = detok.add_tokens(_encode(tokenizer, "a sto"))
    assert (first, stopped) == ("a ", False)  # "sto" may begin the stop string
    second, stopped = detok.add_tokens(_encode(tokenizer, "ry"))
    assert (second, stopped) == ("story", False)  # it did not: released
    third, _ = detok.add_tokens(_encode(tokenizer, " stop"))
    assert third == " " and detok.flush() == "stop"  # request ended: held text comes out


def test_earliest_stop_wins_and_stop_at_start(tokenizer):
    ids = _encode(tokenizer, "Hello world, this")
    deltas, stopped = _stream(IncrementalDetokenizer(tokenizer, PROMPT, stop=["this", "world", "xyz"]), ids, (3,))
    assert stopped and "".join(deltas) == "Hello "
    deltas, stopped = _stream(IncrementalDetokenizer(tokenizer, PROMPT, stop=["Hel"]), ids)
    assert stopped and "".join(deltas) == ""


def test_text_without_stop_hits_is_complete(tokenizer):
    text = "mixed: Ünïcödé → ∑ 🧪 done"
    ids = _encode(tokenizer, text)
    deltas, stopped = _stream(IncrementalDetokenizer(tokenizer, PROMPT, stop=["🧪!", "done."]), ids)
    assert not stopped and "".join(deltas) == text


class _CountingTokenizer:
    """Wraps a real tokenizer and counts the tokens it is asked to decode (test double)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_decoded = 0

    def decode(self, token_ids, skip_special_tokens=True):
        self.num_decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_tokens_that_decode_to_nothing_do_not_make_detokenizing_quadratic(tokenizer):
    # Second review, finding 10: the window never advanced over tokens that decode to
    # nothing (skipped special tokens), so each step decoded all of them again.
    counting = _CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, PROMPT)
    special = tokenizer.convert_tokens_to_ids("</s>")
    text = ""
    for _ in range(2000):
        text += detok.add_tokens([special])[0]
    text += detok.add_tokens(_encode(tokenizer, "héllo 🎉"))[0] + detok.flush()
    assert text == "héllo 🎉"
    assert counting.num_decoded < 20 * 2000  # a handful per token, not 2000 per token


@pytest.mark.parametrize("text", TEXTS)
def test_text_is_unchanged_with_skipped_special_tokens_between_characters(tokenizer, text):
    special = tokenizer.convert_tokens_to_ids("</s>")
    ids = []
    for token_id in _encode(tokenizer, text):
        ids += [token_id, special]
    detok = IncrementalDetokenizer(tokenizer, PROMPT)
    out = "".join(detok.add_tokens([i])[0] for i in ids) + detok.flush()
    assert out == tokenizer.decode(ids, skip_special_tokens=True) == text


def _stream_one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str, int | None]:
    """The text and the 1-based index of the token that completed a stop string (None: no stop)."""
    text = ""
    for index, token_id in enumerate(ids, start=1):
        delta, stopped = detok.add_tokens([token_id])
        text += delta
        if stopped:
            return text, index
    return text + detok.flush(), None


def test_no_stop_string_ends_in_the_first_min_tokens_tokens(tokenizer):
    ids = _encode(tokenizer, "Hello world, this is plain ASCII.")
    hello_end = next(i for i in range(1, len(ids) + 1) if "Hello" in tokenizer.decode(ids[:i]))
    this_end = next(i for i in range(1, len(ids) + 1) if "this" in tokenizer.decode(ids[:i]))
    assert hello_end < this_end
    # Without min_tokens "Hello" stops at once; with it, only a stop completed after token min_tokens counts.
    assert _stream_one_by_one(IncrementalDetokenizer(tokenizer, PROMPT, stop=["Hello", "this"]), ids) == ("", hello_end)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["Hello", "this"], min_tokens=hello_end)
    assert _stream_one_by_one(detok, ids) == ("Hello world, ", this_end)
    # A stop completed by token min_tokens + 1 counts.
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["this"], min_tokens=this_end - 1)
    assert _stream_one_by_one(detok, ids) == ("Hello world, ", this_end)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["this"], min_tokens=this_end)
    assert _stream_one_by_one(detok, ids) == (tokenizer.decode(ids), None)


def test_a_stop_string_begun_within_min_tokens_and_completed_after_counts(tokenizer):
    ids = _encode(tokenizer, "Hello world, this")
    stop = "world,"
    begun = next(i for i in range(1, len(ids) + 1) if "wor" in tokenizer.decode(ids[:i]))
    ended = next(i for i in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:i]))
    if begun == ended:
        pytest.skip("the stop string does not span tokens with this vocabulary")
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=[stop], min_tokens=begun)
    assert _stream_one_by_one(detok, ids) == ("Hello ", ended)


# ------------------------------------------------------------------ options (vLLM's)


def test_include_stop_str_in_output_keeps_the_stop_string_and_drops_what_follows(tokenizer):
    ids = _encode(tokenizer, "Hello world, this is plain")
    for group_sizes in ((1,), (4,)):
        detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["this", "world"], include_stop_str_in_output=True)
        deltas, stopped = _stream(detok, ids, group_sizes)
        assert stopped and "".join(deltas) == "Hello world"
    text = "emoji 🎉🚀 party"
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["🎉🚀"], include_stop_str_in_output=True)
    deltas, stopped = _stream(detok, _encode(tokenizer, text))
    assert stopped and "".join(deltas) == "emoji 🎉🚀"


def test_include_stop_str_in_output_still_honours_min_tokens(tokenizer):
    ids = _encode(tokenizer, "stop and stop again")
    within = len(_encode(tokenizer, "stop"))  # the first "stop" ends within min_tokens
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["stop"], min_tokens=within, include_stop_str_in_output=True)
    deltas, stopped = _stream(detok, ids)
    assert stopped and "".join(deltas) == "stop and stop"


class _RecordingTokenizer:
    """The tokenizer with every decode call's options recorded."""

    def __init__(self, tokenizer):
        self.tokenizer, self.options = tokenizer, []

    def decode(self, token_ids, **options):
        self.options.append(options)
        return self.tokenizer.decode(token_ids, **options)


@pytest.mark.parametrize("skip", [True, False])
def test_spaces_between_special_tokens_goes_to_decode_only_when_false(tokenizer, skip):
    ids = _encode(tokenizer, "ab") + [tokenizer.bos_token_id, tokenizer.eos_token_id] + _encode(tokenizer, "cd")
    default = _RecordingTokenizer(tokenizer)
    text = "".join(_stream(IncrementalDetokenizer(default, PROMPT, skip_special_tokens=skip), ids)[0])
    assert {tuple(o.items()) for o in default.options} == {(("skip_special_tokens", skip),)}
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    recorded = _RecordingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(recorded, PROMPT, skip_special_tokens=skip, spaces_between_special_tokens=False)
    text = "".join(_stream(detok, ids)[0])
    assert {tuple(o.items()) for o in recorded.options} == {
        (("skip_special_tokens", skip), ("spaces_between_special_tokens", False))
    }
    # A fast tokenizer ignores the option (as vLLM's fast detokenizer does): the text is decode()'s.
    assert text == tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=False)


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_adds_no_text_unless_include_stop_str_in_output(tokenizer, include):
    ids = _encode(tokenizer, "ab cd")
    stop_id = _encode(tokenizer, " party")[0]
    streams = RequestStreams(tokenizer)
    request = Request("r", [1], SamplingParams(stop_token_ids=(stop_id,), include_stop_str_in_output=include))
    streams.open(request)
    for token_id in [*ids, stop_id]:
        request.output_token_ids.append(token_id)
        if token_id == stop_id:  # the scheduler ends it on its stop token before the text is read
            request.status = RequestStatus.FINISHED_STOPPED
        streams.add_token(request, SampledToken(token_id))
    events = [e.event for e in streams.take()]
    assert [t for e in events for t in e.token_ids] == [*ids, stop_id]  # the id is reported either way
    assert "".join(e.text for e in events) == tokenizer.decode([*ids, stop_id] if include else ids)
