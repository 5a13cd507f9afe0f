"""Incremental detokenization and stop strings, without a model."""

import random

import pytest
from server_support import tiny_tokenizer

from dflash.text.detok import IncrementalDecoder, StopMatcher, complete_text


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _stream(decoder, ids, chunk_sizes):
    out, i = [], 0
    for n in chunk_sizes:
        out.append(decoder.push(ids[i:i + n]))
        i += n
    out.append(decoder.push(ids[i:]))
    return "".join(out) + decoder.flush()


@pytest.mark.parametrize("text", ["hello world, how are you today?", "caf\u00e9 \u65e5\u672c\u8a9e \U0001f600 ok",
                                  "  spaces  and\nnew lines\n"])
def test_incremental_decode_equals_full_decode(tok, text):
    ids = tok(text, add_special_tokens=False).input_ids
    rng = random.Random(0)
    for _ in range(5):
        sizes = [rng.randint(1, 3) for _ in range(len(ids))]
        assert _stream(IncrementalDecoder(tok), ids, sizes) == tok.decode(ids) == text


def test_half_characters_are_held_back(tok):
    ids = tok("\U0001f600", add_special_tokens=False).input_ids
    assert len(ids) > 1  # the emoji's 4 bytes are split over several tokens
    dec = IncrementalDecoder(tok)
    assert [dec.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.push(ids[-1:]) == "\U0001f600"


def test_random_byte_tokens_decode_like_full(tok):
    rng = random.Random(1)
    ids = [rng.randrange(len(tok)) for _ in range(200)]
    assert _stream(IncrementalDecoder(tok), ids, [rng.randint(1, 4) for _ in range(60)]) == complete_text(
        tok.decode(ids, skip_special_tokens=True))


def test_a_half_character_at_the_end_is_dropped(tok):
    """Cut mid-character (max_tokens): the answer ends before it, never in U+FFFD."""
    ids = tok("ok \U0001f600", add_special_tokens=False).input_ids
    assert tok.decode(ids[:-1]).endswith("\ufffd")
    dec = IncrementalDecoder(tok)
    text = dec.push(ids[:-1]) + dec.flush()
    assert text == "ok " and complete_text(tok.decode(ids[:-1])) == "ok "


def _feed_all(matcher, pieces):
    out = []
    for p in pieces:
        text, hit = matcher.feed(p)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize("pieces,stops,expected", [
    (["hello ", "wor", "ld"], ["world"], ("hello ", True)),
    (["hel", "lo"], ["xyz"], ("hello", False)),
    (["ab", "c", "d"], ["cd", "bc"], ("a", True)),  # the earliest stop string in the text wins
    (["aaa", "ab"], ["aab"], ("aa", True)),
    (["x", "STO"], ["STOP"], ("xSTO", False)),  # a partial stop string at the end is let out
    (["one\n\n", "two"], ["\n\n"], ("one", True)),
    (["abc"], [], ("abc", False)),
])
def test_stop_strings(pieces, stops, expected):
    assert _feed_all(StopMatcher(stops), pieces) == expected


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["</end>"])
    assert m.feed("text </e") == ("text ", False)
    assert m.feed("x more") == ("</ex more", False)
