"""A batched generator for regenerating training responses with the target: left padding,
one forward per step with no per-step processors, and the chosen layers' hidden states of
every real token (prompt and response) captured on the way, so training never re-runs the
target."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass
class Generated:
    prompt_ids: list[int]
    response_ids: list[int]  # stops after (and includes) the first stop token
    features: torch.Tensor  # (len(prompt)+len(response)-1, k*H) fp16: hidden of every token fed to the target
    finished: bool  # True when a stop token ended it
    label_ids: list[int] | None = None  # the target's token at each position, when it differs from the tokens


def _cache_kwargs(model, cache) -> dict:
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], layer_ids: list[int], max_new_tokens: int,
                   stop_ids: list[int], pad_id: int, temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> list[Generated]:
    """Generate for a batch of tokenized prompts. The features of a sequence are the hidden
    states of the tokens the target consumed: all prompt tokens and all response tokens but
    the last (which was only produced)."""
    from transformers import DynamicCache

    b = len(prompts)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids = torch.full((b, width), pad_id, dtype=torch.long)  # (B, T) left padded
    mask = torch.zeros((b, width), dtype=torch.long)  # (B, T)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    cache = DynamicCache(config=model.config)
    stop = torch.tensor(stop_ids)
    feats: list[torch.Tensor] = []  # per step (B, T_step, k*H)
    out_tokens: list[torch.Tensor] = []  # per step (B,)
    done = torch.zeros(b, dtype=torch.bool)
    step_ids, step_pos = ids, pos
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=True,
                    output_hidden_states=True, logits_to_keep=1, **_cache_kwargs(model, cache))
        feats.append(torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1).half())  # (B, T, k*H)
        logits = out.logits[:, -1].float()  # (B, V)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]  # (B,)
        else:
            nxt = logits.argmax(-1)  # (B,)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out_tokens.append(nxt)
        done |= torch.isin(nxt, stop)
        if bool(done.all()):
            break
        step_ids = nxt[:, None]  # (B, 1)
        step_pos = step_pos[:, -1:] + 1  # (B, 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (B, T+1); finished rows are cut later
    tokens = torch.stack(out_tokens, dim=1)  # (B, N)
    all_feats = torch.cat(feats, dim=1)  # (B, width + N - 1, k*H)
    results = []
    for i in range(b):
        resp = []
        finished = False
        for t in tokens[i].tolist():
            resp.append(t)
            if t in stop_ids:
                finished = True
                break
        n_in = lengths[i] + len(resp) - 1  # tokens the target consumed for this row
        f = all_feats[i, width - lengths[i]: width - lengths[i] + n_in].clone()  # (n_in, k*H)
        results.append(Generated(prompts[i], resp, f, finished))
    return results
