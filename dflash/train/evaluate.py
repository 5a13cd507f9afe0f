"""Evaluation while training: per-position accuracy on held-out sequences (fixed anchors) and
tau from running `dflash_generate` on a few evaluation prompts per domain."""

from __future__ import annotations

import torch

from dflash.engine.loop import DraftHead
from dflash.train.blocks import IGNORE, draft_hidden

EVAL_EPOCH = 10_000_019  # a fixed anchor seed for held-out evaluation, never a training epoch


def block_scores(correct: torch.Tensor, labels: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """correct, labels: (N, Q). Returns per-position accuracy (B-1,), counts (B-1,), and the
    mean acceptance length a greedy verifier would give (leading correct positions + 1)."""
    n, q = labels.shape
    c = correct.view(n, q // block_size, block_size)[..., 1:]  # (N, nb, B-1)
    valid = (labels != IGNORE).view(n, q // block_size, block_size)[..., 1:]  # (N, nb, B-1)
    acc = (c & valid).sum((0, 1)).float() / valid.sum((0, 1)).clamp(min=1)  # (B-1,)
    real = valid[..., 0]  # (N, nb) blocks with at least one label
    run = (c & valid).long().cumprod(-1).sum(-1)  # (N, nb) leading correct positions
    tau = float((run[real] + 1).float().mean()) if real.any() else 0.0
    return acc, valid.sum((0, 1)), tau


def spread(n: int, k: int) -> list[int]:
    """k of the indices 0..n-1 evenly spaced from the first to the last (all when n <= k): the
    held-out sequences come in the order of the pool's folders, so a prefix would score the
    first folder only."""
    if k <= 0:
        return []
    if n <= k:
        return list(range(n))
    return [round(i * (n - 1) / (k - 1)) for i in range(k)] if k > 1 else [0]


class Evaluator:
    def __init__(self, trainer, tokenizer, max_heldout: int = 32):
        self.t, self.tok = trainer, tokenizer
        self.heldout_idx = spread(len(trainer.heldout), max_heldout)
        self.prompts = None

    @torch.no_grad()
    def heldout(self) -> dict:
        t = self.t
        if not self.heldout_idx:
            return {}
        t.draft.eval()
        accs, tot, taus, n = 0, 0, [], 0
        head = DraftHead.build(t.draft, t.target)  # the rows the draft proposes from, gathered once
        for s in range(0, len(self.heldout_idx), t.cfg.batch_size):
            b = t.make_batch(self.heldout_idx[s:s + t.cfg.batch_size], EVAL_EPOCH, t.heldout)
            hidden = draft_hidden(t.draft, t.target, b)  # (N, Q, H)
            pred = torch.full_like(b.labels, -1)  # (N, Q)
            sel = b.labels != IGNORE
            h = hidden[sel]  # (M, H)
            pieces = [self._propose(h[i:i + t.cfg.logits_chunk], head) for i in range(0, h.shape[0], t.cfg.logits_chunk)]
            if pieces:
                pred[sel] = torch.cat(pieces)
            acc, cnt, tau = block_scores(pred == b.labels, b.labels, t.cfg.block_size)
            accs = accs + acc * cnt
            tot = tot + cnt
            taus.append(tau * len(b.labels))
            n += len(b.labels)
        t.draft.train()
        acc = (accs / tot.clamp(min=1)).tolist()
        return {"heldout_acc": acc, "heldout_acc1": float(acc[0]), "heldout_block_tau": sum(taus) / max(n, 1)}

    def _propose(self, h: torch.Tensor, head: DraftHead) -> torch.Tensor:
        """(m, H) -> (m,) the draft's greedy proposal, from its draft vocabulary when it has one."""
        return head.to_vocab(self.t.target.logits(h, head.rows).argmax(-1))

    def _eval_prompts(self):
        if self.prompts is None:
            from dflash.text import prompts as P
            k = self.t.cfg.eval_tau_prompts
            self.prompts = {"math": P.math(limit=k), "code": P.humaneval(limit=k), "chat": P.mtbench(limit=k)}
        return self.prompts

    @torch.no_grad()
    def tau(self) -> dict:
        from dflash.engine.loop import dflash_generate
        from dflash.engine.stats import SpecStats
        from dflash.train.data import data_stop_ids

        t, tok = self.t, self.tok
        t.draft.eval()
        stop = data_stop_ids(tok)
        out = {}
        for domain, prompts in self._eval_prompts().items():
            stats = SpecStats()
            for p in prompts:
                ids = torch.tensor([p.ids(tok)], device=t.device)  # no chat template: the plain text
                r = dflash_generate(t.draft, t.target, ids, t.cfg.eval_tau_tokens, stop, 0.0, return_stats=True)
                stats = stats.merge(r.stats)
            out[f"tau_{domain}"] = stats.mean_acceptance_length  # the one tau (engine/stats.py)
        out["tau_mean"] = sum(out.values()) / len(out)
        t.draft.train()
        return out

    def run(self, tau: bool) -> dict:
        res = self.heldout()
        if tau and self.tok is not None:
            res.update(self.tau())
        return res
