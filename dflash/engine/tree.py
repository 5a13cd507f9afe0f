"""Token trees for tree verification: several candidate continuations of the committed text,
shared prefixes merged once, verified by the target in one pass and walked to the longest
path it agrees with.

A tree hangs under its *root*, the last committed token (not yet in the target's cache). Its
nodes are numbered so that every parent comes before its children; `parents` is -1 for the
root's children. Row 0 of a verify pass is the root, row 1+i is node i.

Sources: `Candidate` paths (the n-gram matcher, `engine.suffix`) and the DFlash draft's
per-position distributions (best-first over its top-k, path score = product of the draft's
probabilities, as DDTree). Each node keeps the best score any source gave it, so a parent
never scores below its child, and `TreeBuilder.build` cuts to a node budget best-first.

The walk (`walk`) is exact for any tree: greedy descends into the child holding the target's
argmax; sampled draws the target's own token at each node and descends into the child that
holds it (sample-and-match), so every emitted token is a draw from the target."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dflash.engine.sampling import SamplingParams, next_token


@dataclass(frozen=True)
class Candidate:
    """A proposed continuation. scores[i]: the source's estimate that tokens[:i+1] are all
    accepted (non-increasing along the path)."""
    tokens: tuple[int, ...]
    scores: tuple[float, ...]
    source: str = "suffix"

    def __post_init__(self):
        if len(self.tokens) != len(self.scores):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.scores)} scores")

    @property
    def score(self) -> float:
        return self.scores[-1] if self.scores else 0.0


@dataclass(frozen=True)
class TokenTree:
    tokens: torch.Tensor  # (N,) long, the proposed token of each node
    parents: torch.Tensor  # (N,) long, the parent's node index, -1 for the root's children
    depth: torch.Tensor  # (N,) long, 1 for the root's children
    scores: torch.Tensor  # (N,) float, the best source score of each node
    sources: tuple[str, ...]  # per node: the sources that proposed it, "+"-joined ("draft+suffix")
    children: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)  # (parent, token) -> node

    def __post_init__(self):
        kids = {}
        for i, (p, t) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            if p >= i:
                raise ValueError(f"node {i}'s parent {p} does not come before it")
            if (p, t) in kids:
                raise ValueError(f"node {i} repeats token {t} under parent {p}")
            kids[(p, t)] = i
        object.__setattr__(self, "children", kids)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def empty(cls, device=None) -> "TokenTree":
        """No proposals: a verify pass over the root alone is a plain decoding step."""
        none = torch.empty(0, dtype=torch.long, device=device)
        return cls(none, none, none, torch.empty(0, device=device), ())

    def attention_mask(self) -> torch.Tensor:
        """(1+N, 1+N) bool over [root ; nodes]: each row sees the root, its ancestors and itself."""
        n = len(self)
        mask = torch.zeros(1 + n, 1 + n, dtype=torch.bool, device=self.tokens.device)  # (1+N, 1+N)
        mask[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                mask[1 + i] = mask[1 + p]
            mask[1 + i, 1 + i] = True
        return mask

    def positions(self, start: int) -> torch.Tensor:
        """(1+N,) positions of [root ; nodes] when the root sits at `start` (the committed length)."""
        zero = torch.zeros(1, dtype=torch.long, device=self.depth.device)
        return start + torch.cat([zero, self.depth])  # (1+N,)

    def subtree(self, node: int) -> list[int]:
        """`node` and its descendants (node indices, in order)."""
        inside, out = {node}, [node]
        for i in range(node + 1, len(self)):
            if int(self.parents[i]) in inside:
                inside.add(i)
                out.append(i)
        return out


def path_rows(path: Sequence[int], device=None) -> torch.Tensor:
    """(1+A,) the rows of [root ; nodes] on the root and an accepted path of node indices."""
    return torch.tensor([0] + [1 + i for i in path], dtype=torch.long, device=device)


class TreeBuilder:
    """Collects nodes from any number of sources, then `build`s a TokenTree of the best ones."""

    def __init__(self):
        self._node: dict[tuple[int, int], int] = {}  # (parent, token) -> node, parent -1 = the root
        self._token: list[int] = []
        self._parent: list[int] = []
        self._score: list[float] = []
        self._sources: list[set[str]] = []

    def _add(self, parent: int, token: int, score: float, source: str) -> int:
        node = self._node.get((parent, token))
        if node is None:
            node = self._node[(parent, token)] = len(self._token)
            self._token.append(token)
            self._parent.append(parent)
            self._score.append(score)
            self._sources.append({source})
        else:
            self._score[node] = max(self._score[node], score)
            self._sources[node].add(source)
        return node

    def add_candidates(self, candidates: Sequence[Candidate], weight: float = 1.0) -> "TreeBuilder":
        """Merge candidate paths (shared prefixes once); `weight` scales the source's scores
        (a calibration, e.g. its running acceptance)."""
        for cand in candidates:
            node = -1
            for token, score in zip(cand.tokens, cand.scores):
                node = self._add(node, int(token), weight * float(score), cand.source)
        return self

    def add_draft(self, probs: torch.Tensor, top_k: int, max_nodes: int, weight: float = 1.0,
                  ids: torch.Tensor | None = None, source: str = "draft") -> "TreeBuilder":
        """probs: (K, V) the draft's distributions at the K positions after the root (one
        draft pass; V may be a draft vocabulary whose ids (V,) are `ids`). Adds the
        `max_nodes` best paths over the top_k tokens of each position, best first, path
        score = product of the draft's probabilities."""
        if probs.shape[0] == 0 or max_nodes <= 0:
            return self
        vals, idx = probs.float().topk(min(top_k, probs.shape[-1]), dim=-1)  # (K, k) each
        if ids is not None:
            idx = ids.to(idx.device)[idx]
        vals, idx = vals.tolist(), idx.tolist()
        # entries: (-score, tie, depth index, rank, parent node, parent score); successors of a
        # popped node: its first child (next depth, rank 0) and its next sibling (same depth, rank+1)
        heap, tie = [(-vals[0][0], 0, 0, 0, -1, 1.0)], 1
        for _ in range(max_nodes):
            if not heap:
                break
            neg, _, d, r, parent, parent_score = heapq.heappop(heap)
            if -neg <= 0:
                break
            node = self._add(parent, idx[d][r], weight * -neg, source)
            if r + 1 < len(vals[d]):
                heapq.heappush(heap, (-parent_score * vals[d][r + 1], tie, d, r + 1, parent, parent_score))
                tie += 1
            if d + 1 < len(vals):
                heapq.heappush(heap, (neg * vals[d + 1][0], tie, d + 1, 0, node, -neg))
                tie += 1
        return self

    def build(self, budget: int, device=None) -> TokenTree:
        """The `budget` best nodes, best first, each kept only with its parent (a frontier
        heap from the root's children: parents are always numbered before their children)."""
        kids: dict[int, list[int]] = {}
        for node, parent in enumerate(self._parent):
            kids.setdefault(parent, []).append(node)
        depth_of = {-1: 0}
        frontier = [(-self._score[c], 1, c) for c in kids.get(-1, [])]
        heapq.heapify(frontier)
        order: list[int] = []
        while frontier and len(order) < budget:
            _, depth, node = heapq.heappop(frontier)
            depth_of[node] = depth
            order.append(node)
            for c in kids.get(node, []):
                heapq.heappush(frontier, (-self._score[c], depth + 1, c))
        new = {old: i for i, old in enumerate(order)}
        new[-1] = -1

        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)
        return TokenTree(tensor([self._token[o] for o in order]), tensor([new[self._parent[o]] for o in order]),
                         tensor([depth_of[o] for o in order]), tensor([self._score[o] for o in order], torch.float),
                         tuple("+".join(sorted(self._sources[o])) for o in order))


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # the accepted nodes, root to leaf
    token: int  # the target's token after them: recovered (a child was rejected) or bonus (at a leaf)


def walk(tree: TokenTree, logits: torch.Tensor | Callable[[torch.Tensor], torch.Tensor], params: SamplingParams,
         generator: torch.Generator | None = None) -> Verdict:
    """The verdict on a verified tree. logits: (1+N, V) the target's logits at [root ; nodes],
    or a function rows (R,) -> (R, V) that computes them on demand: it is called on the root
    row, then once on the subtree of the root's child that matched, so a rejected first
    token costs one row of the lm_head. At each node the target's token (greedy: argmax;
    sampled: a draw from its temperature/top-k/top-p distribution) picks the child to
    descend into; the walk stops at the first node without a matching child, and the
    target's token there is the verdict's `token`: the recovered token where that node has
    children (all rejected), the bonus token where it is a leaf (its whole path accepted)."""
    head = logits if callable(logits) else (lambda rows: logits[rows])
    device = tree.tokens.device
    rows = {0: 0}
    block = head(torch.zeros(1, dtype=torch.long, device=device))  # (1, V)
    node, path = -1, []
    while True:
        row = 1 + node
        if row not in rows:  # first descent below the root: this node's whole subtree at once
            sub = tree.subtree(node)
            rows = {1 + n: i for i, n in enumerate(sub)}
            block = head(torch.tensor([1 + n for n in sub], dtype=torch.long, device=device))  # (R, V)
        token = int(next_token(block[rows[row]][None], params, generator)[0])
        child = tree.children.get((node, token))
        if child is None:
            return Verdict(path, token)
        path.append(child)
        node = child
