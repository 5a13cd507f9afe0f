"""Random anchors, the sparse block attention mask and the loss weights (DFLASH.md §3).

A sequence of L tokens has context features for tokens 0..L-2 (the target consumed them).
An anchor a (a response position) starts one block: tokens [t_a, mask x (B-1)] at positions
a..a+B-1, labels t_{a+1}..t_{a+B-1}. The block's queries see the context features strictly
before a and the whole block itself, never another block."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IGNORE = -100


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(B,) weights per block position: 0 for the anchor, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def anchor_bounds(prompt_len: int, seq_len: int) -> tuple[int, int]:
    """The inclusive range of valid anchors: the first response token (the token the target
    produced from the prompt) up to the second-to-last token (so one label exists)."""
    return prompt_len, seq_len - 2


def sample_anchors(prompt_len: int, seq_len: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """Up to n distinct anchors in anchor_bounds, sorted; (n',) long."""
    lo, hi = anchor_bounds(prompt_len, seq_len)
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    count = hi - lo + 1
    pick = torch.randperm(count, generator=generator)[: min(n, count)]
    return (lo + pick).sort().values


@dataclass
class BlockBatch:
    target_hidden: torch.Tensor  # (N, C, k*H) context features, zero padded
    position_ids: torch.Tensor  # (N, C+Q)
    block_ids: torch.Tensor  # (N, Q) [anchor token, mask...] per block; mask id on padding
    labels: torch.Tensor  # (N, Q) IGNORE on anchors, padding and past the sequence end
    weights: torch.Tensor  # (N, Q) loss weight per query position (0 where IGNORE)
    attention_mask: torch.Tensor  # (N, 1, Q, C+Q) bool, True = attend
    num_tokens: int  # real context tokens in the batch

    def to(self, device):
        return BlockBatch(*(getattr(self, f).to(device) for f in
                            ("target_hidden", "position_ids", "block_ids", "labels", "weights", "attention_mask")),
                          self.num_tokens)


def build_batch(seqs: list[tuple], block_size: int, mask_token_id: int, gamma: float) -> BlockBatch:
    """seqs: (tokens (L,), features (L-1, k*H), anchors (n,)[, labels (L,)]) per sequence.
    labels[p] is the token the target gives at position p (default: tokens[p], as for
    target-regenerated responses); the anchor token is always tokens[a]."""
    bsz = block_size
    n = len(seqs)
    ctx = max(item[1].shape[0] for item in seqs)
    q = max(1, max(len(item[2]) for item in seqs)) * bsz
    feat_dim = seqs[0][1].shape[1]
    w_block = loss_weights(bsz, gamma)  # (B,)
    target_hidden = torch.zeros(n, ctx, feat_dim)  # (N, C, kH)
    position_ids = torch.zeros(n, ctx + q, dtype=torch.long)  # (N, C+Q)
    block_ids = torch.full((n, q), mask_token_id, dtype=torch.long)  # (N, Q)
    labels = torch.full((n, q), IGNORE, dtype=torch.long)  # (N, Q)
    weights = torch.zeros(n, q)  # (N, Q)
    mask = torch.zeros(n, 1, q, ctx + q, dtype=torch.bool)  # (N, 1, Q, C+Q)
    position_ids[:, :ctx] = torch.arange(ctx)
    offs = torch.arange(bsz)  # (B,)
    for i, item in enumerate(seqs):
        tokens, feats, anchors = item[:3]
        targets = item[3] if len(item) > 3 else tokens
        length = tokens.shape[0]
        target_hidden[i, : feats.shape[0]] = feats.float()
        for j in range(q // bsz):
            s = slice(j * bsz, (j + 1) * bsz)
            mask[i, 0, s, ctx + j * bsz: ctx + (j + 1) * bsz] = True  # the block sees itself (padding too: no empty rows)
            if j >= len(anchors):
                position_ids[i, ctx + j * bsz: ctx + (j + 1) * bsz] = offs
                continue
            a = int(anchors[j])
            position_ids[i, ctx + j * bsz: ctx + (j + 1) * bsz] = a + offs
            mask[i, 0, s, :a] = True  # context strictly before the anchor
            block_ids[i, j * bsz] = tokens[a]
            pos = a + offs[1:]  # (B-1,) label positions
            ok = pos < length
            lab = torch.full((bsz - 1,), IGNORE, dtype=torch.long)
            lab[ok] = targets[pos[ok]]
            labels[i, j * bsz + 1: (j + 1) * bsz] = lab
            weights[i, j * bsz + 1: (j + 1) * bsz] = w_block[1:] * ok
    num_tokens = sum(int(item[0].shape[0]) for item in seqs)
    return BlockBatch(target_hidden, position_ids, block_ids, labels, weights, mask, num_tokens)


def draft_hidden(draft, target, batch: BlockBatch) -> torch.Tensor:
    """The draft's final hidden states for every block position: (N, Q, H)."""
    noise = target.embed(batch.block_ids, draft.config.input_embedding_scale if hasattr(draft, "config")
                         else 1.0)  # (N, Q, H)
    return draft(position_ids=batch.position_ids, attention_mask=batch.attention_mask,
                 noise_embedding=noise, target_hidden=batch.target_hidden)


class VocabSubset:
    """The loss restricted to the vocabulary rows in `ids`: a softmax over those rows only. It
    cuts the lm_head cost by V/|ids| on a CPU. Two uses: every label token of the data (the
    draft still proposes with the full lm_head), or the draft vocabulary itself
    (`drop_missing`: labels outside it cannot be proposed, so they carry no loss)."""

    def __init__(self, ids: torch.Tensor, vocab_size: int, drop_missing: bool = False):
        self.ids = ids.unique().sort().values  # (S,)
        self.lut = torch.full((vocab_size,), -1, dtype=torch.long)
        self.lut[self.ids] = torch.arange(len(self.ids))
        self.drop_missing = drop_missing

    def keep(self, labels: torch.Tensor) -> torch.Tensor:
        """(N, Q) bool: labelled positions the subset can score."""
        sel = labels != IGNORE
        if self.drop_missing:
            sel &= self.lut.to(labels.device)[labels.clamp(min=0)] >= 0
        return sel

    def logits(self, target, h: torch.Tensor) -> torch.Tensor:
        w = target.head.weight[self.ids.to(h.device)]  # (S, H)
        return h @ w.T  # (m, S)

    def map(self, y: torch.Tensor) -> torch.Tensor:
        out = self.lut.to(y.device)[y]
        if bool((out < 0).any()):
            raise ValueError("a label token is outside the loss vocabulary subset")
        return out


def chunked_loss_backward(hidden: torch.Tensor, target, labels: torch.Tensor, weights: torch.Tensor,
                          scale: float, chunk: int, backward: bool = True,
                          subset: VocabSubset | None = None) -> tuple[float, torch.Tensor]:
    """sum_k w_k * CE(lm_head(hidden_k), label_k) * scale over the labelled positions, with
    the lm_head run in chunks so only one chunk's logits live at a time. With backward=True
    the gradient flows into `hidden`'s graph. Returns (loss value, correct (M,) bool)."""
    sel = labels != IGNORE if subset is None else subset.keep(labels)  # (N, Q)
    h_all = hidden[sel]  # (M, H)
    y, w = labels[sel], weights[sel]  # (M,)
    if subset is not None:
        y = subset.map(y)
    h = h_all.detach().requires_grad_(backward)
    total, correct = 0.0, []
    for s in range(0, h.shape[0], chunk):
        hc = h[s:s + chunk]  # (m, H)
        logits = (target.logits(hc) if subset is None else subset.logits(target, hc)).float()  # (m, V or S)
        ce = torch.nn.functional.cross_entropy(logits, y[s:s + chunk], reduction="none")  # (m,)
        loss = (ce * w[s:s + chunk]).sum() * scale
        if backward:
            loss.backward()
        total += float(loss.detach())
        correct.append(logits.argmax(-1) == y[s:s + chunk])
    if backward and h.shape[0]:
        h_all.backward(h.grad)
    return total, torch.cat(correct) if correct else torch.zeros(0, dtype=torch.bool)


def cosine_lambda(total_steps: int, warmup_frac: float):
    warm = max(1, int(round(total_steps * warmup_frac)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, total_steps - warm))
        return 0.5 * (1 + math.cos(math.pi * t))
    return f
