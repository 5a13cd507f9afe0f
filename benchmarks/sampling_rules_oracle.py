"""tau of the two lossless sampling rules with an oracle draft (docs/METHOD.md §2), on a tiny target.

    .venv/bin/python benchmarks/sampling_rules_oracle.py

The oracle drafts each block token by token from the target's own distribution p, mixed with
noise (q = softmax(log p + eps * N(0, 1))): eps = 0 is a perfect draft, larger eps a worse one.
Both rules are lossless (tests/test_sampling.py); this measures which accepts more.
Writes benchmarks/sampling_rules_oracle.json."""

import json
import statistics
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.engine import loop as gen
from dflash.engine.config import DFlashConfig
from dflash.engine.draft import DFlashDraftModel
from dflash.engine.sampling import SamplingParams, probabilities, sample

BLOCK, NEW, PROMPTS = 8, 32, 4


def oracle_draft(eps: float, noise: torch.Generator):
    def draft_fn(draft, target, cache, ctx_hidden, last, pos, size, mask_id, params, generator, head=None):
        prefix = torch.cat([draft_fn.prompt, torch.tensor([draft_fn.generated], dtype=torch.long)], 1)  # ends with last
        tokens, qs = [], []
        for _ in range(size - 1):
            with torch.no_grad():
                logits = target.model(prefix).logits[:, -1]  # (1, V)
            logq = torch.log(probabilities(logits, params).clamp_min(1e-30))
            q = torch.softmax(logq + eps * torch.randn(logq.shape, generator=noise), -1)  # (1, V)
            tok = q.argmax(-1) if params.rule == "match" else sample(q, generator)
            tokens.append(tok)
            qs.append(q)
            prefix = torch.cat([prefix, tok[:, None]], 1)
        probs = None if params.rule == "match" else torch.stack(qs, 1)  # (1, S-1, V)
        return gen._Block(torch.stack(tokens, 1), probs)
    return draft_fn


def main():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)  # a peaked, LLM-like next-token distribution
    draft = DFlashDraftModel(DFlashConfig.for_target(cfg, num_hidden_layers=1, block_size=BLOCK)).eval()
    results = {}
    for eps in (0.0, 0.5, 1.5):
        for rule in ("rejection", "match"):
            fn = oracle_draft(eps, torch.Generator().manual_seed(1))
            taus = []
            for i in range(PROMPTS):
                prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(100 + i))
                fn.prompt = prompt
                params = SamplingParams(1.0, rule=rule)
                g = torch.Generator().manual_seed(i)
                steps = gen.stream_generate(draft, target, prompt, NEW, None, params, BLOCK, None, g)
                lengths = []
                gen._draft, saved = fn, gen._draft
                try:
                    fn.generated = []
                    for k, step in enumerate(steps):
                        fn.generated += step.tokens
                        if k:
                            lengths.append(len(step.tokens))
                finally:
                    gen._draft = saved
                taus.append(sum(lengths) / len(lengths))
            results[f"eps={eps} {rule}"] = round(statistics.mean(taus), 3)
            print(eps, rule, results[f"eps={eps} {rule}"], flush=True)
    out = {"command": "python benchmarks/sampling_rules_oracle.py", "block_size": BLOCK, "temperature": 1.0,
           "max_new_tokens": NEW, "prompts": PROMPTS, "mean_tau": results}
    Path(__file__).with_name("sampling_rules_oracle.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
