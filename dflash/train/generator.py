"""A batched generator for regenerating training responses with the target: left padding,
one forward per step with no per-step processors, and the chosen layers' hidden states of
every real token (prompt and response) captured on the way, so training never re-runs the
target."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from dflash.engine import static_decoder


@dataclass
class Generated:
    prompt_ids: list[int]
    response_ids: list[int]  # stops after (and includes) the first stop token
    features: torch.Tensor  # (len(prompt)+len(response)-1, k*H) fp16: hidden of every token fed to the target
    finished: bool  # True when a stop token ended it
    label_ids: list[int] | None = None  # the target's token at each position, when it differs from the tokens
    soft: SoftLabels | None = None  # the target's distribution over each response token


@dataclass
class SoftLabels:
    """The target's next-token distribution at R positions, kept as its top k: ids (R, k)
    int32, their log-probabilities (R, k) fp16, and the log of the remaining mass (R,) fp16."""
    ids: torch.Tensor  # (R, k) int32
    logprobs: torch.Tensor  # (R, k) fp16
    rest: torch.Tensor  # (R,) fp16

    @classmethod
    def from_logits(cls, logits: torch.Tensor, k: int) -> SoftLabels:
        """logits (R, V) -> the top k of their softmax and the log of what is left."""
        lp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
        top, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)  # (R, k)
        rest = torch.log((1.0 - top.exp().sum(-1)).clamp(min=1e-10))  # (R,)
        return cls(ids.int().cpu(), top.half().cpu(), rest.half().cpu())

    @classmethod
    def cat(cls, parts: list[SoftLabels]) -> SoftLabels:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("ids", "logprobs", "rest")))

    def __len__(self) -> int:
        return self.ids.shape[0]


def _cache_kwargs(model, cache) -> dict:
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


class _HFSteps:
    """HF's own forward on a DynamicCache (any model)."""

    def __init__(self, model, mask: torch.Tensor, layer_ids: list[int], max_new_tokens: int):
        from transformers import DynamicCache

        self.model, self.mask, self.layer_ids = model, mask, layer_ids  # mask: (B, T) long, 0 at padding
        self.cache = DynamicCache(config=model.config)

    def compact_at(self, batch: int) -> int:
        return 1  # dropping a row from a DynamicCache is as cheap as its next concatenation

    def prefill(self, ids, positions):
        return self(ids, positions)

    def __call__(self, ids, positions):
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                         output_hidden_states=True, logits_to_keep=1, **_cache_kwargs(self.model, self.cache))
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)  # (A, T+1) for the next token
        return out.logits[:, -1], torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    def select(self, rows):
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]


class _StaticSteps:
    """The lean forward of `static_decoder` on a preallocated KV buffer (Llama family)."""

    def __init__(self, model, mask: torch.Tensor, layer_ids: list[int], max_new_tokens: int):
        b, width = mask.shape
        self.model, self.layer_ids = model, layer_ids
        self.kv = static_decoder.KVBuffer(model, b, width + max_new_tokens)
        self.valid = torch.ones(b, width + max_new_tokens, dtype=torch.bool, device=mask.device)  # (B, S) False at padding
        self.valid[:, :width] = mask.bool()
        self.head = model.get_output_embeddings()

    def compact_at(self, batch: int) -> int:
        return max(1, batch // 4)  # a compaction copies the buffer: wait for a quarter of the rows

    def prefill(self, ids, positions):
        """Each prompt alone, without its padding (most of a padded batch's prefill is
        padding when lengths vary), its K/V then placed at the row's slots of the buffer."""
        b, width = ids.shape
        logits, feats = [], None
        for i, n in enumerate(self.valid[:, :width].sum(-1).tolist()):  # n: the row's prompt length
            one = static_decoder.KVBuffer(self.model, 1, n)
            final, f = static_decoder.forward(self.model, ids[i:i + 1, width - n:], positions[i:i + 1, width - n:],
                                              one, None, self.layer_ids)  # (1, n, H), (1, n, k*H)
            self.kv.k[:, i, :, width - n:width], self.kv.v[:, i, :, width - n:width] = one.k[:, 0], one.v[:, 0]
            if feats is None:
                feats = f.new_zeros(b, width, f.shape[-1])  # (B, T, k*H)
            feats[i, width - n:] = f[0]
            logits.append(self.head(final[0, -1]))
        self.kv.length = width
        return torch.stack(logits), feats  # (B, V), (B, T, k*H)

    def __call__(self, ids, positions):
        end = self.kv.length + ids.shape[1]
        final, feats = static_decoder.forward(self.model, ids, positions, self.kv, self.valid[:, :end], self.layer_ids)
        return self.head(final[:, -1]), feats  # (A, V), (A, T, k*H)

    def select(self, rows):
        self.kv.select(rows)
        self.valid = self.valid[rows]


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], layer_ids: list[int], max_new_tokens: int,
                   stop_ids: list[int], pad_id: int, temperature: float = 0.0,
                   generator: torch.Generator | None = None, static: bool | None = None,
                   topk: int = 0) -> list[Generated]:
    """Generate for a batch of tokenized prompts. The features of a sequence are the hidden
    states of the tokens the target consumed: all prompt tokens and all response tokens but
    the last (which was only produced). Finished rows leave the batch (and its cache).
    `static`: use the lean static-buffer forward (default: when the model supports it).
    `topk` > 0: also keep the target's top-k distribution over every response token (`soft`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    b, dev = len(prompts), model.get_input_embeddings().weight.device
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids = torch.full((b, width), pad_id, dtype=torch.long)  # (B, T) left padded
    mask = torch.zeros((b, width), dtype=torch.long)  # (B, T)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    if static is None:
        static = static_decoder.supports(model)
    steps = (_StaticSteps if static else _HFSteps)(model, mask, layer_ids, max_new_tokens)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=dev)
    hidden = model.config.get_text_config().hidden_size
    feats = torch.zeros(b, width + max_new_tokens - 1, len(layer_ids) * hidden, dtype=torch.float16,
                        device=dev)  # (B, T+N-1, k*H)
    tokens = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=dev)  # (B, N)
    n_out = torch.full((b,), max_new_tokens, device=dev)  # (B,) response length of each row
    stopped = torch.zeros(b, dtype=torch.bool, device=dev)  # (B,) ended by a stop token
    alive = torch.arange(b, device=dev)  # (A,) original rows still in the batch
    live = torch.ones(b, dtype=torch.bool, device=dev)  # (A,) still generating (a finished row waits for a compaction)
    soft = _SoftBuffer(b, max_new_tokens, topk) if topk > 0 else None
    step_ids, step_pos, t = ids, pos, 0
    for s in range(max_new_tokens):
        logits, f = (steps.prefill if s == 0 else steps)(step_ids, step_pos)  # (A, V), (A, T_step, k*H)
        feats[alive, t:t + f.shape[1]] = f.half()
        t += f.shape[1]
        logits = logits.float()
        if soft is not None:
            soft.put(alive[live].cpu(), s, SoftLabels.from_logits(logits[live], topk))
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]  # (A,)
        else:
            nxt = logits.argmax(-1)  # (A,)
        tokens[alive[live], s] = nxt[live]
        ends = live & torch.isin(nxt, stop)  # (A,) rows that stop here
        n_out[alive[ends]], stopped[alive[ends]] = s + 1, True
        live &= ~ends
        if not bool(live.any()):
            break
        if int((~live).sum()) >= steps.compact_at(len(live)):  # drop finished rows from the batch and the cache
            sel = live.nonzero()[:, 0]
            steps.select(sel)
            alive, nxt, step_pos, live = alive[sel], nxt[sel], step_pos[sel], live[sel]
        step_ids = nxt[:, None]  # (A, 1)
        step_pos = step_pos[:, -1:] + 1  # (A, 1)
    results, tokens, n_out, stopped, feats = [], tokens.cpu(), n_out.cpu(), stopped.cpu(), feats.cpu()
    for i in range(b):
        resp = tokens[i, :n_out[i]].tolist()
        n_in = lengths[i] + len(resp) - 1  # tokens the target consumed for this row
        f = feats[i, width - lengths[i]: width - lengths[i] + n_in].clone()  # (n_in, k*H)
        results.append(Generated(prompts[i], resp, f, bool(stopped[i]),
                                 soft=soft.row(i, len(resp)) if soft is not None else None))
    return results


class _SoftBuffer:
    """The top-k distributions of a generating batch, by (row, step)."""

    def __init__(self, b: int, n: int, k: int):
        self.ids = torch.zeros(b, n, k, dtype=torch.int32)  # (B, N, k)
        self.logprobs = torch.zeros(b, n, k, dtype=torch.float16)  # (B, N, k)
        self.rest = torch.zeros(b, n, dtype=torch.float16)  # (B, N)

    def put(self, rows: torch.Tensor, step: int, soft: SoftLabels) -> None:
        self.ids[rows, step], self.logprobs[rows, step], self.rest[rows, step] = soft.ids, soft.logprobs, soft.rest

    def row(self, i: int, n: int) -> SoftLabels:
        return SoftLabels(self.ids[i, :n].clone(), self.logprobs[i, :n].clone(), self.rest[i, :n].clone())


@torch.inference_mode()
def prefill_features(model, sequences: list[list[int]], layer_ids: list[int], static: bool | None = None,
                     prompt_lens: list[int] | None = None, topk: int = 0
                     ) -> tuple[list[torch.Tensor], list[SoftLabels] | None]:
    """The features `generate_batch` would have captured for sequences it wrote (prompt +
    response): one target forward per sequence over every token but the last, without
    padding. Rebuilds a data shard from stored responses at the cost of a prefill. With
    `topk` > 0 (and each sequence's prompt length) also the top-k distributions over the
    response tokens, as `generate_batch(topk=...)` keeps them; else None."""
    dev = model.get_input_embeddings().weight.device
    if static is None:
        static = static_decoder.supports(model)
    if topk > 0 and (prompt_lens is None or len(prompt_lens) != len(sequences)):
        raise ValueError("prefill_features with topk needs one prompt length per sequence")
    feats, softs = [], [] if topk > 0 else None
    for j, seq in enumerate(sequences):
        ids = torch.tensor(seq[:-1], device=dev)[None]  # (1, n): the tokens the target consumed
        pos = torch.arange(ids.shape[1], device=dev)[None]  # (1, n)
        start = prompt_lens[j] - 1 if topk > 0 else ids.shape[1] - 1  # the first position whose logits we keep
        if static:
            kv = static_decoder.KVBuffer(model, 1, ids.shape[1])
            final, f = static_decoder.forward(model, ids, pos, kv, None, layer_ids)  # (1, n, H), (1, n, k*H)
            logits = model.get_output_embeddings()(final[0, start:]) if topk > 0 else None  # (R, V)
        else:
            out = model(input_ids=ids, position_ids=pos, output_hidden_states=True, use_cache=False,
                        logits_to_keep=ids.shape[1] - start)
            f = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)  # (1, n, k*H)
            logits = out.logits[0]  # (R, V)
        feats.append(f[0].half().cpu())
        if topk > 0:
            softs.append(SoftLabels.from_logits(logits, topk))
    return feats, softs
