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
    the last (which was only produced). A row leaves the batch (and its cache) as soon as it
    emits a stop token, so finished rows cost nothing."""
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
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
    stop = torch.tensor(stop_ids, dtype=torch.long)
    hidden = model.config.get_text_config().hidden_size
    feats = torch.zeros(b, width + max_new_tokens - 1, len(layer_ids) * hidden, dtype=torch.float16)  # (B, T+N-1, k*H)
    tokens = torch.full((b, max_new_tokens), pad_id, dtype=torch.long)  # (B, N)
    n_out = torch.full((b,), max_new_tokens)  # (B,) response length of each row
    stopped = torch.zeros(b, dtype=torch.bool)  # (B,) ended by a stop token
    alive = torch.arange(b)  # (A,) original rows still generating
    step_ids, step_pos, t = ids, pos, 0
    for s in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=True,
                    output_hidden_states=True, logits_to_keep=1, **_cache_kwargs(model, cache))
        f = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1).half()  # (A, T_step, k*H)
        feats[alive, t:t + f.shape[1]] = f
        t += f.shape[1]
        logits = out.logits[:, -1].float()  # (A, V)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]  # (A,)
        else:
            nxt = logits.argmax(-1)  # (A,)
        tokens[alive, s] = nxt
        keep = ~torch.isin(nxt, stop)  # (A,)
        n_out[alive[~keep]], stopped[alive[~keep]] = s + 1, True
        if not bool(keep.any()):
            break
        if not bool(keep.all()):  # drop finished rows from the batch and the cache
            sel = keep.nonzero()[:, 0]
            cache.batch_select_indices(sel)
            alive, nxt, mask, step_pos = alive[sel], nxt[sel], mask[sel], step_pos[sel]
        step_ids = nxt[:, None]  # (A, 1)
        step_pos = step_pos[:, -1:] + 1  # (A, 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (A, T+1)
    results = []
    for i in range(b):
        resp = tokens[i, :n_out[i]].tolist()
        n_in = lengths[i] + len(resp) - 1  # tokens the target consumed for this row
        f = feats[i, width - lengths[i]: width - lengths[i] + n_in].clone()  # (n_in, k*H)
        results.append(Generated(prompts[i], resp, f, bool(stopped[i])))
    return results
