"""The n-gram proposer: a suffix automaton over token ids, grown incrementally, proposes what
followed the earlier occurrences of the text's longest recurring suffix; the global index does
the same over earlier responses within a token budget."""

import random

import pytest

from dflash.engine.suffix import GlobalSuffixIndex, SuffixIndex
from dflash.engine.tree import TreeBuilder


def brute_match(text: list[int]) -> int:
    """Length of the longest suffix of `text` that also ends at an earlier index."""
    n = len(text)
    return max((m for m in range(1, n) if any(text[e - m + 1:e + 1] == text[n - m:] for e in range(m - 1, n - 1))),
               default=0)


def brute_continuations(text: list[int], m: int, max_len: int) -> list[tuple[int, ...]]:
    """What followed each earlier occurrence, the text extended as if it kept repeating from there."""
    n, out = len(text), []
    for e in range(m - 1, n - 1):
        if text[e - m + 1:e + 1] == text[n - m:]:
            longer = list(text)
            while len(longer) < e + 1 + max_len:
                longer.append(longer[len(longer) - (n - 1 - e)])
            out.append(tuple(longer[e + 1:e + 1 + max_len]))
    return out


@pytest.mark.parametrize("alphabet", [2, 3, 7])
def test_incremental_index_equals_brute_force(alphabet):
    """Grown in chunks of 1-5 tokens: after each, the match length, the distinct maximal
    continuations and their scores equal a brute-force scan of the text."""
    rng = random.Random(alphabet)
    text = [rng.randrange(alphabet) for _ in range(90)]
    index, i = SuffixIndex(text[:3], max_occurrences=10_000), 3
    while i < len(text):
        step = rng.randint(1, 5)
        index.extend(text[i:i + step])
        i += step
        seen = text[:i]
        m = brute_match(seen)
        assert index.match_length() == m
        cands = index.propose(max_len=4, max_branches=1000)
        if m == 0:
            assert cands == []
            continue
        conts = brute_continuations(seen, m, 4)
        leaves = {c for c in conts if not any(len(o) > len(c) and o[:len(c)] == c for o in conts)}
        assert {c.tokens for c in cands} == leaves
        for c in cands:
            for k in range(1, len(c.tokens) + 1):
                agree = sum(o[:k] == c.tokens[:k] for o in conts)
                assert c.scores[k - 1] == pytest.approx(agree / len(conts) * m / (m + k))
        assert [sum(c.scores) for c in cands] == sorted((sum(c.scores) for c in cands), reverse=True)
    assert len(index._sam.length) <= 2 * len(text)  # a suffix automaton has at most 2n states


def test_repeated_code_is_copied_and_branches_where_it_varied():
    line = [10, 11, 12, 13, 14]  # a line of code seen three times, then a fourth time
    text = [90] + line + [1, 99] + [91] + line + [2, 99] + [92] + line + [1, 99] + [93] + line
    index = SuffixIndex(text)
    assert index.match_length() == 5
    cands = index.propose(max_len=2, max_branches=3)
    assert [c.tokens for c in cands] == [(1, 99), (2, 99)]  # twice (1, 99), once (2, 99)
    assert cands[0].scores == pytest.approx((2 / 3 * 5 / 6, 2 / 3 * 5 / 7)) and cands[0].source == "suffix"
    assert cands[1].scores == pytest.approx((1 / 3 * 5 / 6, 1 / 3 * 5 / 7))
    assert index.propose(max_len=2, max_branches=1) == cands[:1]
    tree = TreeBuilder().add_candidates(cands).build(10)
    assert sorted(tree.tokens.tolist()) == [1, 2, 99, 99] and int((tree.parents == -1).sum()) == 2


def test_min_match_and_bad_tokens():
    index = SuffixIndex([5, 6, 7, 5], min_match=2)
    assert index.match_length() == 1 and index.propose(4) == []
    index.extend([6])
    assert [c.tokens for c in index.propose(4)] == [(7, 5, 6, 7)]  # the loop 5 6 7 continues past the end
    assert SuffixIndex([1, 2, 3]).propose(4) == [] and SuffixIndex().propose(4) == []
    with pytest.raises(ValueError, match=">= 0"):
        index.extend([-3])


def test_global_index_matches_earlier_responses_and_stays_bounded():
    index = GlobalSuffixIndex(max_tokens=64, min_match=3)
    index.add([1, 2, 3, 4, 5, 6])
    index.add([7, 2, 3, 4, 9])
    cands = index.propose([50, 51, 2, 3, 4], max_len=4)
    assert {c.tokens for c in cands} == {(5, 6), (9,)}  # each stops at its response's end
    assert all(c.source == "global" for c in cands)
    assert index.propose([50, 3, 4], max_len=4) == []  # a match of 2 < min_match
    rng = random.Random(0)
    for _ in range(40):  # many responses later: the first two are gone, the memory stays bounded
        index.add([rng.randrange(20, 40) for _ in range(9)])
        assert len(index) <= 64
    assert index.propose([50, 51, 2, 3, 4], max_len=4) == []
    index.add([60, 61, 62, 63])
    assert [c.tokens for c in index.propose([60, 61, 62], max_len=4)] == [(63,)]
    index.add(list(range(100, 200)))  # longer than half the budget: its tail is kept
    assert len(index) <= 64 and [c.tokens for c in index.propose([197, 198], max_len=4)] == []
    assert [c.tokens for c in index.propose([196, 197, 198], max_len=4)] == [(199,)]
    with pytest.raises(ValueError, match="max_tokens"):
        GlobalSuffixIndex(max_tokens=3)
