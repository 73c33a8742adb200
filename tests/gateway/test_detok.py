"""Incremental detokenization: however tokens are batched, the text equals one decode of all of them,
and a stop string cuts it exactly before the first occurrence, never showing any piece of it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llumdask.api.gateway.detok import IncrementalText

VOCAB = 512


def batches_of(tokens: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(tokens) + 1) for c in cuts} | {0, len(tokens)})
    return [tokens[a:b] for a, b in zip(points, points[1:], strict=False)]


def run(tokenizer, batches, stop=(), include_stop=False):
    text = IncrementalText(tokenizer, stop, include_stop=include_stop)
    deltas = [text.add(b) for b in batches] + [text.finish()]
    return text, deltas


token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=60)
cut_lists = st.lists(st.integers(0, 1000), max_size=10)


@settings(max_examples=300)
@given(tokens=token_lists, cuts=cut_lists)
def test_deltas_add_up_to_the_decoded_text(tokenizer, tokens, cuts):
    text, deltas = run(tokenizer, batches_of(tokens, cuts))
    assert "".join(d.text for d in deltas) == tokenizer.decode(tokens) == text.text
    assert not any(d.stopped for d in deltas)


@settings(max_examples=300)
@given(tokens=token_lists, cuts=cut_lists, data=st.data())
def test_stop_string_cuts_before_its_first_occurrence(tokenizer, tokens, cuts, data):
    full = tokenizer.decode(tokens)
    # A stop string taken from the text itself (so that it occurs), or an arbitrary one.
    if full and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(full) - 1))
        stop = full[i : i + data.draw(st.integers(1, 4))]
    else:
        stop = data.draw(st.text(min_size=1, max_size=3))
    include = data.draw(st.booleans())
    text, deltas = run(tokenizer, batches_of(tokens, cuts), [stop], include_stop=include)
    expected = full[: full.find(stop) + (len(stop) if include else 0)] if stop in full else full
    assert "".join(d.text for d in deltas) == expected == text.text
    assert text.stopped == (stop in full)
    stopped_at = next((i for i, d in enumerate(deltas) if d.stopped), len(deltas))
    assert all(d.text == "" for d in deltas[stopped_at + 1 :])


@settings(max_examples=300)
@given(tokens=token_lists, cuts=cut_lists, data=st.data())
def test_of_several_stop_strings_past_min_tokens_the_one_ending_first_stops_as_in_vllm(tokenizer, tokens, cuts, data):
    """vLLM's rule (its check_stop_strings and detokenizer): of the stop strings found past
    min_tokens, the one that ends first in the text, then the first listed; it is the stop_reason,
    and the tokens after the one completing it are dropped, however the tokens arrive."""
    full = tokenizer.decode(tokens)
    pieces = st.builds(lambda i, n: full[i % len(full):][:n], st.integers(0, 10**6), st.integers(1, 5)) if full else st.nothing()
    stops = data.draw(st.lists(st.one_of(pieces, st.text(min_size=1, max_size=3)), min_size=1, max_size=4, unique=True))
    include = data.draw(st.booleans())
    min_tokens = data.draw(st.integers(0, 4))
    batches = batches_of(tokens, cuts)
    text = IncrementalText(tokenizer, stops, include_stop=include, min_tokens=min_tokens)
    deltas, kept = [], len(tokens)
    for done, batch in zip(itertools.accumulate(map(len, [[], *batches])), batches):
        deltas.append(text.add(batch))
        if deltas[-1].kept is not None:
            kept = done + deltas[-1].kept
            break
    deltas.append(text.finish())
    # vLLM's rule written out: a stop counts past min_tokens where it ends in a later token's text;
    # the tokens up to the one whose text reaches its end are kept.
    offsets = [len(tokenizer.decode(tokens[:k]).rstrip("\ufffd")) for k in range(len(tokens) + 1)]
    least = offsets[min_tokens] if len(tokens) > min_tokens else None
    found = [] if least is None else [
        (i + len(s), order, s) for order, s in enumerate(stops) if (i := full.find(s, max(0, least - len(s) + 1))) >= 0]
    if not found:
        assert text.stop_string is None and text.text == full and kept == len(tokens)
        return
    end, _, stop = min(found)
    assert text.stop_string == stop
    assert "".join(d.text for d in deltas) == text.text == full[: end if include else end - len(stop)]
    assert kept == next((k for k in range(1, len(tokens) + 1) if offsets[k] >= end), len(tokens))


def test_partial_characters_are_held_back_until_complete(tokenizer):
    tokens = tokenizer.encode("caf\u00e9 \u20ac", add_special_tokens=False)
    text = IncrementalText(tokenizer)
    shown = [text.add([t]).text for t in tokens]
    assert all("\ufffd" not in s for s in shown)
    assert "".join(shown) + text.finish().text == "caf\u00e9 \u20ac"


def test_empty_stop_strings_are_refused(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalText(tokenizer, [""])


def test_special_tokens_show_when_asked(tokenizer):
    tokens = [*tokenizer.encode("Hi", add_special_tokens=False), tokenizer.eos_token_id]
    shown = IncrementalText(tokenizer, skip_special_tokens=False)
    text = shown.add(tokens).text + shown.finish().text
    assert text == tokenizer.decode(tokens, skip_special_tokens=False) != tokenizer.decode(tokens)


@pytest.mark.parametrize("include_stop", [False, True])
def test_the_stop_token_has_no_text_unless_asked_as_in_vllm(tokenizer, include_stop):
    """vLLM leaves the token that ended the request out of the text (special tokens kept or not)."""
    words = tokenizer.encode("Hi there", add_special_tokens=False)
    ender = tokenizer.encode(" world", add_special_tokens=False)[-1]
    for stop_id, skip in ((tokenizer.eos_token_id, False), (ender, True)):
        text = IncrementalText(tokenizer, skip_special_tokens=skip, stop_token_ids=[stop_id], include_stop=include_stop)
        shown = text.add(words[:1]).text + text.add([*words[1:], stop_id]).text + text.finish().text
        expected = words + [stop_id] if include_stop else words
        assert shown == tokenizer.decode(expected, skip_special_tokens=skip)
