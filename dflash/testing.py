"""Tiny random models for tests, ours and yours: a few-layer Llama / Qwen3 / Gemma3 target with
a 96-token vocabulary, a matching random draft, a byte-level tokenizer trained on a few lines,
a whole `Pipeline` of them, and a stand-in kernel timer (`fake_timer`). Nothing is
downloaded; everything is seeded. Exactness tests run on these in seconds (greedy output must
equal the target's own, whatever the weights)."""

from __future__ import annotations

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
SPECIALS = ["<|unused|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts a block of tokens",
          "the target verifies every draft token in one pass", "hello world, how are you today?",
          "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe", "\u65e5\u672c\u8a9e \u4e2d\u6587 \U0001f600"]


def tiny_target(family: str, seed: int = 0, **overrides):
    """A random HF causal LM: "llama", "qwen3" or "gemma3" (three sliding-window layers of
    width 4, one global layer)."""
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw))
    elif family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(head_dim=16, sliding_window=4, layer_types=[
            "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"], **kw))
    else:
        raise ValueError(f"unknown tiny target family {family!r}: use llama, qwen3 or gemma3")
    return model.eval()


def tiny_draft(target, seed: int = 1, layers: int = 2, block_size: int = 8, **kw):
    """A random DFlash draft shaped for `target` (an HF model)."""
    import torch

    from dflash.engine.config import DFlashConfig
    from dflash.engine.draft import DFlashDraftModel

    torch.manual_seed(seed)
    return DFlashDraftModel(DFlashConfig.for_target(target.config, num_hidden_layers=layers,
                                                    block_size=block_size, **kw)).eval()


def tiny_tokenizer():
    """A byte-level BPE (so any text encodes, and bytes can split characters) trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_pipeline(seed: int = 0, block_size: int = 4, max_positions: int = 256, perfect: bool = False):
    """A random 2-layer Llama target and a random 1-layer draft with `tiny_tokenizer`.
    perfect=True zeroes the target's lm_head, so target and draft both always pick token 0 (a
    non-stop special): every draft token is accepted, which exercises the acceptance counters.
    Tiny models run fastest on one thread."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.engine.config import DFlashConfig
    from dflash.engine.draft import DFlashDraftModel
    from dflash.engine.target import TargetModel
    from dflash.text.pipeline import Pipeline

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=not perfect)
    target = LlamaForCausalLM(cfg).eval()
    if perfect:
        target.lm_head.weight.data.zero_()
    dcfg = DFlashConfig.for_target(cfg, num_hidden_layers=1, block_size=block_size,
                                   mask_token_id=tok.convert_tokens_to_ids("<|MASK|>"))
    return Pipeline(TargetModel(target), DFlashDraftModel(dcfg).eval(), tok, draft_trained=False)


def exact_law(model, prompt, params):
    """P(t1, t2, t3 | prompt) under the target's own sampling (temperature, top-k, top-p), by
    enumerating every (t1, t2): a (V^3,) vector indexed t1*V*V + t2*V + t3. For vocabularies of
    a few tokens. model: an HF causal LM; prompt: (1, T) token ids."""
    import itertools

    import torch

    from dflash.engine.sampling import probabilities

    v = model.config.vocab_size
    seqs = torch.tensor(list(itertools.product(range(v), repeat=2)))  # (V^2, 2)
    with torch.no_grad():
        logits = model(torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)).logits  # (V^2, T+2, V)
    p = probabilities(logits[:, -3:], params)  # (V^2, 3, V): p(t1|x), p(t2|x,t1), p(t3|x,t1,t2)
    rows = torch.arange(len(seqs))
    law = p[rows, 0, seqs[:, 0], None] * p[rows, 1, seqs[:, 1], None] * p[:, 2]  # (V^2, V)
    return law.flatten()


def chi2_pvalue(counts, law) -> float:
    """Chi-square goodness of fit of observed `counts` to the probabilities `law` (same shape),
    pooling the cells too rare for the approximation (expected < 5) into one."""
    import torch
    from scipy.stats import chisquare

    keep = law * counts.sum() >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([law[keep], law[~keep].sum()[None]]) * counts.sum()
    if exp[-1] == 0:  # nothing rare but cells the law excludes (callers assert those stay empty)
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def markov_target(vocab: int = 4, seed: int = 3, sharpness: float = 8.0):
    """A tiny 2-layer Llama whose attention is switched off (every o_proj zero): each position
    sees only its own token, so the target is a Markov chain over `vocab` tokens and a long
    sampled generation can be checked transition by transition (`transition_pvalue`)."""
    import torch

    target = tiny_target("llama", seed=seed, vocab_size=vocab, num_hidden_layers=2, max_position_embeddings=8192)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        target.lm_head.weight.mul_(sharpness)  # transition rows spread over a few tokens
    return target


def transition_table(target, params):
    """(V, V) float64 numpy P[prev, next] of a `markov_target` under its own sampling; checks
    that it is a Markov chain (the same row deep in a context)."""
    import numpy as np
    import torch

    from dflash.engine.sampling import probabilities

    v = target.config.vocab_size
    with torch.no_grad():
        single = target(torch.arange(v)[:, None]).logits[:, -1]  # (V, V) after one token
        seq = torch.arange(2 * v) % v
        later = target(seq[None]).logits[0]  # (2V, V) deep in a context
    np.testing.assert_allclose(later.numpy(), single[seq].numpy(), atol=1e-5)
    table = probabilities(single, params).double().numpy()
    return table / table.sum(-1, keepdims=True)


def transition_pvalue(tokens: list[int], table) -> float:
    """Chi-square goodness of fit of the transition counts of `tokens` to the rows of `table`;
    cells expected fewer than 5 times are pooled within their row; a transition the target never
    samples fails outright."""
    import numpy as np
    from scipy.stats import chisquare

    v = table.shape[0]
    counts = np.zeros((v, v))
    np.add.at(counts, (tokens[:-1], tokens[1:]), 1)
    obs, exp, rows = [], [], 0
    for prev in range(v):
        n = counts[prev].sum()
        if n == 0:
            continue
        want = table[prev] * n
        assert counts[prev][want == 0].sum() == 0, f"a transition the target never samples, from {prev}"
        common = want >= 5
        cells = [(counts[prev][common], want[common])]
        if (~common & (want > 0)).any():
            cells.append(([counts[prev][~common].sum()], [want[~common].sum()]))
        for o, e in cells:
            obs.extend(o)
            exp.extend(e)
        rows += 1
    return float(chisquare(obs, exp, ddof=rows - 1).pvalue)  # one constraint per row: its total


def fake_timer(table: dict, per_call: float = 0.0):
    """A stand-in for the kernel timer (engine/kernels.py's `TimeFn`), so that a test decides
    what "measures fastest": seconds from table[impl] (a list per bucket of kernels.BUCKETS, or
    one number for all; an implementation the table leaves out is slow), times the weight's
    size in thousands of elements (a stack of weights costs their sum), plus `per_call` (a
    fixed cost per product, which stacking saves). Its `calls` list records (impl, shape, n)."""
    from dflash.engine.kernels import BUCKETS

    calls = []

    def time_fn(fn, x, *, impl, shape, n):
        calls.append((impl, shape, n))
        v = table.get(impl, 99.0)
        return (v[BUCKETS.index(n)] if isinstance(v, list) else v) * shape[0] * shape[1] / 1000 + per_call

    time_fn.calls = calls
    return time_fn
