"""Token trees: building (candidate paths, the draft's top-k best first, merged, cut to a
budget), the verdict walk, and tree verification on the target (static decoder and HF's 4D
mask): a tree pass gives each root-to-leaf path's causal numbers, compaction leaves a cache
that continues exactly, greedy output is the target's own and sampled output its law."""

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import MistralConfig, MistralForCausalLM

from dflash.engine.sampling import SamplingParams, probabilities
from dflash.engine.target import TargetModel
from dflash.engine.tree import Candidate, TokenTree, TreeBuilder, path_rows, walk
from dflash.engine.tree_verify import commit_path, tree_forward
from dflash.testing import TINY, chi2_pvalue, exact_law, tiny_target


@pytest.fixture(autouse=True)
def _inference():
    """As the loop runs: the cache's tensors are inference tensors."""
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def targets(llama):
    """(name, TargetModel) for every path: static decoder and HF's, full and sliding layers."""
    qwen3, gemma3 = tiny_target("qwen3"), tiny_target("gemma3")
    return {"llama-static": TargetModel(llama), "llama-hf": TargetModel(llama, static=False),
            "qwen3-static": TargetModel(qwen3), "qwen3-hf": TargetModel(qwen3, static=False),
            "gemma3-hf": TargetModel(gemma3)}


PATHS = ["llama-static", "llama-hf", "qwen3-static", "qwen3-hf", "gemma3-hf"]


def _path(tree: TokenTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = int(tree.parents[node])
    return out[::-1]


def _random_tree(seed: int, vocab: int = 96, budget: int = 24) -> TokenTree:
    """A draft tree of peaked random distributions plus two long candidate paths (depth 7:
    deeper than gemma3's window of 4)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(6, vocab, generator=g), -1)  # (K, V)
    paths = torch.randint(0, vocab, (2, 7), generator=g).tolist()
    cands = [Candidate(tuple(p), tuple(0.9 - 0.1 * k for k in range(7))) for p in paths]
    return TreeBuilder().add_draft(probs, 3, budget).add_candidates(cands).build(budget)


def test_builder_merges_shared_prefixes_and_cuts_best_first():
    cands = [Candidate((5, 6, 7), (0.9, 0.8, 0.1), "suffix"), Candidate((5, 6, 8), (0.9, 0.5, 0.4), "suffix"),
             Candidate((5, 9), (0.3, 0.2), "global")]
    draft = torch.full((2, 12), 0.0)
    draft[0, 5], draft[0, 3], draft[1, 6] = 0.95, 0.05, 1.0  # the draft agrees on 5 6, adds 3
    tree = TreeBuilder().add_candidates(cands).add_draft(draft, top_k=2, max_nodes=10).build(100)
    paths = {tuple(tree.tokens[_path(tree, i)].tolist()) for i in range(len(tree))}
    assert paths == {(5,), (5, 6), (5, 6, 7), (5, 6, 8), (5, 9), (3,), (3, 6)}  # 5 and 5-6 once
    five = tree.children[(-1, 5)]
    assert tree.sources[five] == "draft+global+suffix" and float(tree.scores[five]) == pytest.approx(0.95)
    assert tree.depth.tolist() == [len(_path(tree, i)) for i in range(len(tree))]
    cut = TreeBuilder().add_candidates(cands).add_draft(draft, top_k=2, max_nodes=10).build(4)
    kept = [tuple(cut.tokens[_path(cut, i)].tolist()) for i in range(len(cut))]
    assert kept == [(5,), (5, 6), (5, 6, 8), (5, 9)]  # best first, each with its parent
    assert all(p < i for i, p in enumerate(cut.parents.tolist()))


def test_draft_tree_holds_the_best_paths_over_the_top_k():
    """Best-first over the draft's top-k equals brute force: the `budget` prefixes with the
    highest product of per-position probabilities."""
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(2 * torch.randn(4, 10, generator=g), -1)  # (K, V)
    top = probs.topk(3, -1).indices.tolist()
    score = {}
    for depth in range(1, 5):
        for path in itertools.product(*top[:depth]):
            score[path] = float(torch.tensor([probs[d, t] for d, t in enumerate(path)]).prod())
    for budget in (1, 5, 17, 60):
        tree = TreeBuilder().add_draft(probs, 3, budget).build(budget)
        got = {tuple(tree.tokens[_path(tree, i)].tolist()) for i in range(len(tree))}
        assert got == set(sorted(score, key=score.get, reverse=True)[:budget])
        assert torch.allclose(tree.scores, torch.tensor([score[tuple(tree.tokens[_path(tree, i)].tolist())]
                                                         for i in range(len(tree))]))


def test_draft_vocabulary_ids_map_the_draft_rows():
    probs = torch.tensor([[0.7, 0.3], [0.1, 0.9]])  # (K, 2) over a draft vocabulary {40, 17}
    tree = TreeBuilder().add_draft(probs, 2, 3, ids=torch.tensor([40, 17])).build(3)
    assert [tuple(tree.tokens[_path(tree, i)].tolist()) for i in range(3)] == [(40,), (40, 17), (17,)]


def test_mask_positions_and_rows():
    tree = TreeBuilder().add_candidates([Candidate((1, 2, 3), (0.9, 0.8, 0.7)), Candidate((4,), (0.5,)),
                                         Candidate((1, 5), (0.9, 0.6))]).build(10)
    # nodes: 0:1  1:2  2:3  3:5  4:4 (best first)
    assert tree.tokens.tolist() == [1, 2, 3, 5, 4] and tree.parents.tolist() == [-1, 0, 1, 0, -1]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.attention_mask(), expected)
    assert tree.positions(7).tolist() == [7, 8, 9, 10, 9, 8]
    assert path_rows([0, 3]).tolist() == [0, 1, 4]
    assert tree.subtree(0) == [0, 1, 2, 3] and tree.subtree(4) == [4]
    empty = TokenTree.empty()
    assert torch.equal(empty.attention_mask(), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="repeats"):
        TokenTree(torch.tensor([3, 3]), torch.tensor([-1, -1]), torch.tensor([1, 1]), torch.ones(2), ("a", "a"))


def _one_hot_logits(tree: TokenTree, want: dict[int, int], vocab: int = 12) -> torch.Tensor:
    """(1+N, V) logits whose argmax at row r is want.get(r, 0)."""
    logits = torch.zeros(1 + len(tree), vocab)
    for r in range(1 + len(tree)):
        logits[r, want.get(r, 0)] = 5.0
    return logits


def test_greedy_walk_finds_a_path_planted_deep_in_a_later_branch():
    cands = [Candidate((1, 2, 3, 4), (0.9,) * 4), Candidate((1, 2, 7, 8, 9), (0.5,) * 5),
             Candidate((6, 2), (0.4, 0.3)), Candidate((1, 2, 7, 5), (0.2,) * 4)]
    tree = TreeBuilder().add_candidates(cands).build(20)
    target = [1, 2, 7, 5, 11]  # the target's tokens: follows the last candidate, then 11
    want, node, row = {}, -1, 0
    for t in target:
        want[row] = t
        node = tree.children.get((node, t), None)
        if node is None:
            break
        row = 1 + node
    verdict = walk(tree, _one_hot_logits(tree, want), SamplingParams())
    assert tree.tokens[verdict.path].tolist() == [1, 2, 7, 5] and verdict.token == 11
    rejected = walk(tree, _one_hot_logits(tree, {0: 10}), SamplingParams())
    assert rejected.path == [] and rejected.token == 10


def test_walk_computes_the_head_on_the_root_then_one_subtree():
    tree = TreeBuilder().add_candidates([Candidate((1, 2), (0.9, 0.8)), Candidate((3, 4, 5), (0.7,) * 3)]).build(9)
    logits = _one_hot_logits(tree, {0: 3, 1 + tree.children[(-1, 3)]: 4})
    asked = []

    def head(rows):
        asked.append(rows.tolist())
        return logits[rows]
    verdict = walk(tree, head, SamplingParams())
    assert tree.tokens[verdict.path].tolist() == [3, 4] and verdict.token == 0
    three = tree.children[(-1, 3)]
    assert asked == [[0], [1 + n for n in tree.subtree(three)]]  # never the rows under token 1
    asked.clear()
    logits = _one_hot_logits(tree, {0: 9})  # no child holds 9: the root row alone
    walk(tree, head, SamplingParams())
    assert asked == [[0]]


def test_sampled_walk_draws_the_root_token_from_the_target():
    """One node's draw: the emitted token (an accepted child, or else the recovered token) follows p exactly."""
    tree = TreeBuilder().add_candidates([Candidate((1,), (0.9,)), Candidate((4,), (0.5,))]).build(5)
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    params, g, counts = SamplingParams(0.7, top_k=5), torch.Generator().manual_seed(1), torch.zeros(6)
    for _ in range(4000):
        v = walk(tree, logits, params, g)
        counts[int(tree.tokens[v.path[0]]) if v.path else v.token] += 1
    p = probabilities(logits[0], params)
    keep = p > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep].numpy(), (p[keep] * 4000).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("name", PATHS)
def test_tree_pass_equals_a_causal_pass_over_each_path(targets, name):
    target = targets[name]
    layers = [0, 2, 3]
    for prompt_len, seed in ((2, 0), (9, 1)):  # 9 > gemma3's window: sliding layers drop keys
        ids = torch.randint(0, 96, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
        tree = _random_tree(seed)
        cache = target.new_cache()
        target.forward_hidden(ids[:, :-1], cache, layers)
        start = cache.length
        final, hidden = tree_forward(target, cache, int(ids[0, -1]), tree, layers)  # (1, 1+N, H), (1, 1+N, 3H)
        assert final.shape == (1, 1 + len(tree), 64) and hidden.shape == (1, 1 + len(tree), 192)
        assert cache.length == start + 1 + len(tree) and int(tree.depth.max()) >= 5
        for leaf in range(len(tree)):
            path = _path(tree, leaf)
            ref, ref_hidden = target.forward_hidden(torch.cat([ids, tree.tokens[path][None]], 1), target.new_cache(),
                                                    layers)  # (1, T+A, H)
            rows = path_rows(path)
            assert torch.allclose(final[0, rows], ref[0, start:], atol=1e-5)
            assert torch.allclose(hidden[0, rows], ref_hidden[0, start:], atol=1e-5)
            assert torch.equal(target.logits(final[:, rows]).argmax(-1), target.logits(ref[:, start:]).argmax(-1))


@pytest.mark.parametrize("name", PATHS)
def test_commit_path_leaves_a_cache_that_continues_exactly(targets, name):
    """Three rounds of tree pass and compaction onto a path that is not the first branch
    (a stop-like prefix in the last one); then one token more equals a fresh prefill."""
    target = targets[name]
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    cache, seq, root = target.new_cache(), ids[0, :-1].tolist(), int(ids[0, -1])
    target.forward_hidden(ids[:, :-1], cache, None)
    for step in range(3):
        tree = _random_tree(10 + step)
        start = cache.length
        tree_forward(target, cache, root, tree, None)
        path = _path(tree, len(tree) - 1 - step)  # late nodes: later branches
        path = path[:-1] if step == 2 else path
        commit_path(cache, start, path)
        assert cache.length == start + 1 + len(path)
        seq += [root] + tree.tokens[path].tolist()
        root = int(tree.tokens[path[-1]]) + 1 if path else 7
    final, _ = target.forward_hidden(torch.tensor([[root]]), cache, None)  # (1, 1, H)
    ref, _ = target.forward_hidden(torch.tensor([seq + [root]]), target.new_cache(), None)  # (1, T, H)
    assert torch.allclose(target.logits(final[:, -1]), target.logits(ref[:, -1]), atol=1e-5)


def _tree_steps(target, cache, root, n, make_tree, params, generator=None):
    """The tree loop in miniature from a filled cache: (tree pass, walk, commit) until n new
    tokens. Returns the tokens and each step's accepted length."""
    out, accepted = [], []
    while len(out) < n:
        tree = make_tree(out)
        start = cache.length
        final, _ = tree_forward(target, cache, root, tree, None)  # (1, 1+N, H)
        verdict = walk(tree, lambda rows: target.logits(final[0, rows]), params, generator)
        commit_path(cache, start, verdict.path)
        out += tree.tokens[verdict.path].tolist() + [verdict.token]
        accepted.append(len(verdict.path))
        root = verdict.token
    return out[:n], accepted


@pytest.mark.parametrize("name", PATHS)
def test_greedy_tree_generation_equals_hf_generate(targets, name):
    """Each step's tree holds decoys first and the target's own continuation (depth 1..6)
    in a later branch, sharing a prefix with a decoy; the walk finds all of it."""
    target = targets[name]
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    ref = target.model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0,
                                attention_mask=torch.ones_like(ids))[0, 6:].tolist()
    depths, draft = itertools.cycle([3, 1, 6, 2, 5, 4]), torch.Generator().manual_seed(2)
    planted = []

    def make_tree(out):
        true = ref[len(out):len(out) + next(depths)]
        planted.append(len(true))
        decoy = true[:len(true) // 2] + [(t + 1) % 96 for t in true[len(true) // 2:]]
        cands = [Candidate(tuple(decoy), (0.9,) * len(decoy)), Candidate(((true[0] + 5) % 96, 1), (0.8, 0.7)),
                 Candidate(tuple(true), (0.3,) * len(true))]
        return TreeBuilder().add_candidates(cands).add_draft(torch.rand(4, 96, generator=draft), 2, 6).build(24)
    cache = target.new_cache()
    target.forward_hidden(ids[:, :-1], cache, None)
    out, accepted = _tree_steps(target, cache, int(ids[0, -1]), 30, make_tree, SamplingParams())
    assert out == ref
    assert accepted[:-1] == planted[:-1]  # the planted path, whole, every step


V = 4  # a tiny vocabulary: the exact law of three tokens (64 cells) can be enumerated


@pytest.mark.parametrize("params", [SamplingParams(0.9, top_p=0.95), SamplingParams(1.0, top_k=3)],
                         ids=["top-p", "top-k"])
def test_sampled_tree_walk_follows_the_target_distribution(params):
    """2000 seeded draws of three tokens, each through one or more tree steps (sample-and-
    match) on a 4-token target, with a random tree per prefix: the walk stops at every depth.
    Chi-square against the exact law, which a 5% bias fails; cells the law excludes stay empty.
    One tree pass per distinct prefix serves every draw that reaches it."""
    model = tiny_target("llama", seed=3, vocab_size=V)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    target, prompt = TargetModel(model), [1, 3, 2]
    law = exact_law(model, torch.tensor([prompt]), params)
    assert law.max() < 0.5
    passes, shapes = {}, torch.Generator().manual_seed(12)

    def tree_pass(prefix):
        if prefix not in passes:
            probs = torch.softmax(2 * torch.randn(3, V, generator=shapes), -1)  # (K, V)
            tree = TreeBuilder().add_draft(probs, 3, int(torch.randint(1, 12, (1,), generator=shapes))).build(12)
            seq = prompt + list(prefix)
            cache = target.new_cache()
            target.forward_hidden(torch.tensor([seq[:-1]]), cache, None)
            final, _ = tree_forward(target, cache, seq[-1], tree, None)  # (1, 1+N, H)
            passes[prefix] = tree, target.logits(final)[0]  # (1+N, V)
        return passes[prefix]
    g, counts, lengths = torch.Generator().manual_seed(11), torch.zeros(V ** 3), set()
    for _ in range(2000):
        out = ()
        while len(out) < 3:
            tree, logits = tree_pass(out)
            verdict = walk(tree, logits, params, g)
            out += tuple(tree.tokens[verdict.path].tolist()) + (verdict.token,)
            lengths.add(len(verdict.path))
        a, b, c = out[:3]
        counts[a * V * V + b * V + c] += 1
    assert lengths >= {0, 1, 2}  # rejections at the root and deeper
    assert counts[law == 0].sum() == 0
    assert chi2_pvalue(counts, law) > 1e-3
    biased = law.clone().view(V, V, V)
    biased[..., 0] += 0.05 * biased.sum(-1)
    assert chi2_pvalue(counts, (biased / biased.sum()).flatten()) < 1e-3


def test_sliding_layers_outside_the_covered_families_raise():
    target = TargetModel(MistralForCausalLM(MistralConfig(sliding_window=4, **TINY)).eval())  # sliding everywhere
    cache = target.new_cache()
    target.forward_hidden(torch.tensor([[1, 2, 3]]), cache, None)
    with pytest.raises(ValueError, match="sliding-window layers"):
        tree_forward(target, cache, 4, _random_tree(0), None)
