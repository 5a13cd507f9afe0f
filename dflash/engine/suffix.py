"""N-gram proposals from the text itself: a suffix automaton over token ids, grown one token at
a time (amortized O(1) per token), finds the longest suffix of the text that occurred before
and proposes what followed it there.

`SuffixIndex` is one request's prompt plus generated tokens. `GlobalSuffixIndex` holds earlier
responses for a server to share across requests (SuffixDecoding's idea), bounded in memory:
two generations of at most max_tokens/2 each, the older one dropped whole when the newer
fills. Neither is thread-safe: a server shares a GlobalSuffixIndex under a lock.

Scores are a prior for the tree's node budget, meant to be recalibrated by each source's
running acceptance: a continuation of k tokens that followed c of the n earlier occurrences of
a match of length L scores c/n * L/(L+k) (longer matches and more agreeing occurrences score
higher; each further token a little lower)."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from dflash.engine.tree import Candidate

SEPARATOR = -1  # between responses in the global index: no query holds it, so no match crosses it


class _Automaton:
    """States: `length` of their longest string, suffix `link`, transitions `next`, and for
    states created by an appended token (not clones) `end`, that token's index. The suffix
    links form a tree; the occurrences (end indices) of a state's strings are the `end`s in
    its subtree, found through `kids`."""

    def __init__(self):
        self.tokens: list[int] = []
        self.length = [0]
        self.link = [-1]
        self.next: list[dict[int, int]] = [{}]
        self.end = [-1]
        self.kids: list[set[int] | None] = [None]
        self.last = 0

    def _new(self, length: int, end: int) -> int:
        self.length.append(length)
        self.link.append(-1)
        self.next.append({})
        self.end.append(end)
        self.kids.append(None)
        return len(self.length) - 1

    def _set_link(self, state: int, parent: int) -> None:
        old = self.link[state]
        if old >= 0:
            self.kids[old].discard(state)
        self.link[state] = parent
        if self.kids[parent] is None:
            self.kids[parent] = set()
        self.kids[parent].add(state)

    def append(self, token: int) -> None:
        cur = self._new(self.length[self.last] + 1, len(self.tokens))
        self.tokens.append(token)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p == -1:
            self._set_link(cur, 0)
        else:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self._set_link(cur, q)
            else:  # split q: a clone takes the strings of length <= length[p] + 1
                clone = self._new(self.length[p] + 1, -1)
                self.next[clone] = dict(self.next[q])
                self._set_link(clone, self.link[q])
                self._set_link(q, clone)
                self._set_link(cur, clone)
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
        self.last = cur

    def ends(self, state: int, limit: int) -> list[int]:
        """End indices of up to `limit` occurrences of `state`'s strings (all when fewer), latest first."""
        found, stack = [], [state]
        while stack and len(found) < limit:
            s = stack.pop()
            if self.end[s] >= 0:
                found.append(self.end[s])
            stack.extend(self.kids[s] or ())
        return sorted(found, reverse=True)

    def match(self, context: Sequence[int]) -> tuple[int, int]:
        """(state, length) of the longest suffix of `context` that occurs in the text."""
        state, n = 0, 0
        for token in context:
            while state and token not in self.next[state]:
                state = self.link[state]
                n = self.length[state]
            if token in self.next[state]:
                state, n = self.next[state][token], n + 1
        return state, n

    def _following(self, e: int, max_len: int) -> list[int]:
        """Up to `max_len` tokens after position e, as if the text went on repeating from there:
        past the end, the continuation copies itself (period = the distance from e to the end),
        so a run or a loop the text is in is proposed whole, not one token at a time."""
        n, out = len(self.tokens), []
        for j in range(max_len):
            k = e + 1 + j
            if k >= n and k - n >= len(out):  # an occurrence ending at the end has no continuation
                break
            t = self.tokens[k] if k < n else out[k - n]
            if t == SEPARATOR:
                break
            out.append(t)
        return out

    def continuations(self, state: int, match_len: int, max_len: int, max_branches: int, max_occurrences: int,
                      source: str) -> list[Candidate]:
        """What followed the occurrences of `state`'s strings, scored as the module says."""
        conts = []
        for e in self.ends(state, max_occurrences):
            cont = self._following(e, max_len)
            if cont:
                conts.append(tuple(cont))
        if not conts:
            return []
        prefixes = Counter(c[:k] for c in conts for k in range(1, len(c) + 1))
        distinct = set(conts)
        leaves = [c for c in distinct if not any(len(o) > len(c) and o[:len(c)] == c for o in distinct)]
        cands = [Candidate(c, tuple(prefixes[c[:k]] / len(conts) * match_len / (match_len + k)
                                    for k in range(1, len(c) + 1)), source) for c in leaves]
        # best first by the expected number of accepted tokens, the sum of the path's scores
        cands.sort(key=lambda c: (-sum(c.scores), c.tokens))
        return cands[:max_branches]


class SuffixIndex:
    """One request's text (prompt, then each step's new tokens): `propose` continues its
    longest suffix that occurred earlier in the text."""

    def __init__(self, tokens: Sequence[int] = (), min_match: int = 1, max_occurrences: int = 64):
        self._sam = _Automaton()
        self.min_match = min_match
        self.max_occurrences = max_occurrences
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._sam.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if int(t) < 0:
                raise ValueError(f"token ids are >= 0, got {int(t)}")
            self._sam.append(int(t))

    def tail(self, n: int) -> list[int]:
        """The text's last `n` tokens."""
        return list(self._sam.tokens[-n:]) if n > 0 else []

    def match_length(self) -> int:
        """Length of the longest suffix of the text that also ends earlier in it."""
        return self._sam.length[self._sam.link[self._sam.last]] if self._sam.last else 0

    def propose(self, max_len: int, max_branches: int = 4) -> list[Candidate]:
        """Up to `max_branches` continuations of at most `max_len` tokens, best first: what
        followed the earlier occurrences of the longest recurring suffix."""
        sam = self._sam
        n = self.match_length()
        if n < self.min_match or max_len <= 0:
            return []
        return sam.continuations(sam.link[sam.last], n, max_len, max_branches, self.max_occurrences, "suffix")


class GlobalSuffixIndex:
    """Earlier responses, shared across requests: at most `max_tokens` tokens are held; when
    the newer half fills, the older half is dropped (O(1) amortized per added token)."""

    def __init__(self, max_tokens: int = 1 << 16, min_match: int = 4, max_context: int = 64,
                 max_occurrences: int = 64):
        if max_tokens < 4:
            raise ValueError(f"max_tokens must be >= 4, got {max_tokens}")
        self.max_tokens, self.min_match, self.max_context = max_tokens, min_match, max_context
        self.max_occurrences = max_occurrences
        self._old, self._new = _Automaton(), _Automaton()

    def __len__(self) -> int:
        return len(self._old.tokens) + len(self._new.tokens)

    def add(self, response: Sequence[int]) -> None:
        """Index one finished response (its last max_tokens/2 tokens)."""
        half = self.max_tokens // 2
        response = [int(t) for t in response]
        response = response[max(len(response) - (half - 1), 0):]  # room for the separator
        if len(self._new.tokens) + len(response) + 1 > half:
            self._old, self._new = self._new, _Automaton()
        for t in response + [SEPARATOR]:
            self._new.append(t)

    def propose(self, context: Sequence[int], max_len: int, max_branches: int = 4) -> list[Candidate]:
        """Continuations of the longest suffix of `context` (its last max_context tokens)
        found in the held responses; the newer generation's first on equal scores."""
        context = [int(t) for t in context[-self.max_context:]]
        out = []
        for sam in (self._new, self._old):
            state, n = sam.match(context)
            if n >= self.min_match and max_len > 0:
                out += sam.continuations(state, n, max_len, max_branches, self.max_occurrences, "global")
        return sorted(out, key=lambda c: -c.scores[0])[:max_branches]
