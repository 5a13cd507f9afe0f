"""Random anchors, the sparse block attention mask and the loss weights (docs/METHOD.md §3).

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
    soft: SoftBlock | None = None  # the target's top-k at each query position, when the data has it

    def to(self, device):
        return BlockBatch(*(getattr(self, f).to(device) for f in
                            ("target_hidden", "position_ids", "block_ids", "labels", "weights", "attention_mask")),
                          self.num_tokens, self.soft.to(device) if self.soft is not None else None)


@dataclass
class SoftBlock:
    """Soft labels laid out like `BlockBatch.labels`: the target's top-k ids and log-probabilities
    and the log of the remaining mass at every query position (ids -1, mass 0 where unlabelled)."""
    ids: torch.Tensor  # (N, Q, k) long
    logprobs: torch.Tensor  # (N, Q, k) float
    rest: torch.Tensor  # (N, Q) float

    def to(self, device):
        return SoftBlock(self.ids.to(device), self.logprobs.to(device), self.rest.to(device))

    def __getitem__(self, sel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ids[sel], self.logprobs[sel], self.rest[sel]


def build_batch(seqs: list[tuple], block_size: int, mask_token_id: int, gamma: float) -> BlockBatch:
    """seqs: (tokens (L,), features (L-1, k*H), anchors (n,)[, labels (L,)[, soft]]) per
    sequence. labels[p] is the token the target gives at position p (default: tokens[p], as
    for target-regenerated responses); the anchor token is always tokens[a]. soft: None or
    (start, SoftLabels) with the target's top-k over positions start, start+1, ...; given for
    one sequence, it must be given for all (the batch then carries a `SoftBlock`)."""
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
    softs = [item[4] if len(item) > 4 else None for item in seqs]
    if any(x is None for x in softs) and not all(x is None for x in softs):
        raise ValueError("soft labels for some sequences of a batch but not all")
    soft = _empty_soft(n, q, softs[0][1].ids.shape[1]) if softs[0] is not None else None
    for i, item in enumerate(seqs):
        tokens, feats, anchors = item[:3]
        targets = item[3] if len(item) > 3 and item[3] is not None else tokens
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
            if soft is not None:
                _place_soft(soft, i, j * bsz + 1, pos[ok], *softs[i])
    num_tokens = sum(int(item[0].shape[0]) for item in seqs)
    return BlockBatch(target_hidden, position_ids, block_ids, labels, weights, mask, num_tokens, soft)


def _empty_soft(n: int, q: int, k: int) -> SoftBlock:
    return SoftBlock(torch.full((n, q, k), -1, dtype=torch.long), torch.full((n, q, k), -math.inf),
                     torch.zeros(n, q))  # (N, Q, k), (N, Q, k), (N, Q)


def _place_soft(soft: SoftBlock, i: int, col: int, pos: torch.Tensor, start: int, labels) -> None:
    """Row i, query columns col.. : the soft labels of sequence positions `pos` (rows pos-start)."""
    rows = pos - start  # (m,)
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= len(labels)):
        raise ValueError(f"soft labels cover positions {start}..{start + len(labels) - 1}, "
                         f"a label is at {int(pos.min())}..{int(pos.max())}")
    s = slice(col, col + len(rows))
    soft.ids[i, s] = labels.ids[rows].long()
    soft.logprobs[i, s] = labels.logprobs[rows].float()
    soft.rest[i, s] = labels.rest[rows].float()


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

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """The subset column of each id, -1 for ids outside it (any shape)."""
        return torch.where(ids >= 0, self.lut.to(ids.device)[ids.clamp(min=0)], -1)

    def map(self, y: torch.Tensor) -> torch.Tensor:
        out = self.lut.to(y.device)[y]
        if bool((out < 0).any()):
            raise ValueError("a label token is outside the loss vocabulary subset")
        return out


def distill_kl(logits: torch.Tensor, cols: torch.Tensor, logprobs: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) per row over the buckets {each stored top-k id the logits cover,
    everything else}: logits (m, S) the draft's over its S columns; cols (m, k) the column of
    each top-k id (-1: not a column, its mass joins the rest bucket); logprobs (m, k) and
    rest (m,) the target's, renormalised here (fp16 rounding). Returns (m,)."""
    p_all = logprobs.float().exp()  # (m, k)
    z = p_all.sum(-1) + rest.float().exp()  # (m,) ~1
    inside = cols >= 0  # (m, k)
    p = torch.where(inside, p_all, 0.0) / z[:, None]  # (m, k)
    p_rest = (1.0 - p.sum(-1)).clamp(min=0.0)  # (m,) the tail, and top-k ids outside the columns
    logq = torch.log_softmax(logits.float(), dim=-1)  # (m, S)
    idx = cols.clamp(min=0)  # (m, k)
    logq_in = logq.gather(1, idx)  # (m, k)
    support = torch.zeros_like(logq).scatter_add_(1, idx, inside.float()) > 0  # (m, S)
    logq_rest = torch.logsumexp(logq.masked_fill(support, -math.inf), dim=-1)  # (m,) log(1 - sum q_in)
    kl_in = torch.where(inside, torch.xlogy(p, p) - p * logq_in, 0.0).sum(-1)  # (m,)
    kl_rest = torch.where(p_rest > 0, torch.xlogy(p_rest, p_rest) - p_rest * logq_rest, 0.0)  # (m,)
    return kl_in + kl_rest


def chunked_loss_backward(hidden: torch.Tensor, target, labels: torch.Tensor, weights: torch.Tensor,
                          scale: float, chunk: int, backward: bool = True,
                          subset: VocabSubset | None = None, soft: SoftBlock | None = None,
                          distill_weight: float = 0.0) -> tuple[float, torch.Tensor]:
    """sum_k w_k * loss_k * scale over the labelled positions, loss_k = (1 - d) CE(lm_head(
    hidden_k), label_k) + d KL(target_k || draft_k) with d = `distill_weight` (the KL on the
    `soft` labels, over the same softmax as the CE), with the lm_head run in chunks so only
    one chunk's logits live at a time. With backward=True the gradient flows into `hidden`'s
    graph. Returns (loss value, correct (M,) bool)."""
    if distill_weight and soft is None:
        raise ValueError("distill_weight > 0 needs soft labels (rebuild the data with --topk)")
    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distill_weight must be in [0, 1], got {distill_weight}")
    sel = labels != IGNORE if subset is None else subset.keep(labels)  # (N, Q)
    h_all = hidden[sel]  # (M, H)
    y, w = labels[sel], weights[sel]  # (M,)
    if subset is not None:
        y = subset.map(y)
    s_ids, s_lp, s_rest = soft[sel] if distill_weight else (None, None, None)  # (M, k), (M, k), (M,)
    s_cols = (s_ids if subset is None else subset.columns(s_ids)) if distill_weight else None
    h = h_all.detach().requires_grad_(backward)
    total, correct = 0.0, []
    for s in range(0, h.shape[0], chunk):
        hc, c = h[s:s + chunk], slice(s, s + chunk)  # (m, H)
        logits = (target.logits(hc) if subset is None else subset.logits(target, hc)).float()  # (m, V or S)
        per = torch.nn.functional.cross_entropy(logits, y[c], reduction="none")  # (m,)
        if distill_weight:
            per = (1.0 - distill_weight) * per + distill_weight * distill_kl(logits, s_cols[c], s_lp[c], s_rest[c])
        loss = (per * w[c]).sum() * scale
        if backward:
            loss.backward()
        total += float(loss.detach())
        correct.append(logits.argmax(-1) == y[c])
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
