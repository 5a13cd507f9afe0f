"""`dflash generate`: one prompt through the speculative loop, streamed, then tau and tokens/s."""

from __future__ import annotations

import json
import sys
import time

from dflash.cli.commands import add_model_args, add_spec_args, spec_from_args


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with DFlash speculative decoding, streaming")
    p.add_argument("prompt", nargs="?", help="a user message (sent through the chat template)")
    p.add_argument("--messages", help="chat messages as a JSON list of {role, content}, or @FILE")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    add_model_args(p)
    add_spec_args(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--compare", action="store_true", help="also run the target alone and print the speedup")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run_generate)


def _messages(args) -> list[dict]:
    if args.messages:
        text = args.messages
        if text.startswith("@"):
            with open(text[1:]) as f:
                text = f.read()
        try:
            msgs = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: --messages is not valid JSON: {e}")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
            raise SystemExit("error: --messages must be a JSON list of {\"role\": ..., \"content\": ...} objects")
        return msgs
    if not args.prompt:
        raise SystemExit("error: give a prompt or --messages")
    return [{"role": "user", "content": args.prompt}]


def run_generate(args) -> int:
    import torch

    from dflash.engine.loop import dflash_generate
    from dflash.engine.sampling import SamplingParams
    from dflash.engine.stats import SpecStats
    from dflash.text.detok import IncrementalDecoder
    from dflash.text.pipeline import Pipeline

    pipe = Pipeline.load(args.target, args.draft, quiet=args.json, kernels=getattr(args, "kernels", "auto"),
                         precision=getattr(args, "precision", "auto"),
                         spec=spec_from_args(args))
    if args.raw:
        if not args.prompt:
            raise SystemExit("error: --raw needs a prompt")
        ids = pipe.encode_text(args.prompt)
    else:
        ids = pipe.encode_chat(_messages(args))
    params = SamplingParams(args.temperature, args.top_p, args.top_k)
    gen = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    decoder, stats, tokens, text = IncrementalDecoder(pipe.tokenizer), SpecStats(), [], []
    start = time.perf_counter()
    ttft = None
    for step in pipe.stream(ids, args.max_new_tokens, params, gen):
        if ttft is None:
            ttft = time.perf_counter() - start
        else:
            stats.add_step(step)
        tokens += step.tokens
        text.append(decoder.push(step.tokens))  # only the new text: no re-decoding of the whole output
        if not args.json:
            sys.stdout.write(text[-1])
            sys.stdout.flush()
    text.append(decoder.flush())
    if not args.json:
        sys.stdout.write(text[-1])
    elapsed = time.perf_counter() - start
    tau = stats.mean_acceptance_length
    report = {"text": "".join(text), "num_input_tokens": ids.shape[1],
              "num_output_tokens": len(tokens), "tau": round(tau, 3), "tokens_per_s": round(len(tokens) / elapsed, 2),
              "time_to_first_token_s": round(ttft or 0.0, 4), "draft": pipe.draft_path or "random (untrained)",
              "spec_decode": stats.as_dict()}
    if args.compare:
        base = dflash_generate(None, pipe.target, ids, args.max_new_tokens, pipe.stop_token_ids, args.temperature,
                               block_size=1, top_p=args.top_p, top_k=args.top_k, return_stats=True,
                               generator=torch.Generator().manual_seed(args.seed) if args.seed is not None else None)
        report["target_alone_tokens_per_s"] = round(base.num_output_tokens / base.total_time, 2)
        report["speedup"] = round(report["tokens_per_s"] / report["target_alone_tokens_per_s"], 3)
        if params.greedy:  # the same tokens as the target alone, or the run says it is not
            report["identical_to_target_alone"] = base.output_ids[0, ids.shape[1]:].tolist() == tokens
    if args.json:
        print(json.dumps(report))
    else:
        line = f"\n\n[{len(tokens)} tokens, tau {tau:.2f}, {report['tokens_per_s']:.1f} tokens/s"
        if args.compare:
            line += f", target alone {report['target_alone_tokens_per_s']:.1f} tokens/s, speedup {report['speedup']:.2f}x"
            if "identical_to_target_alone" in report:
                line += ", identical" if report["identical_to_target_alone"] else ", OUTPUT DIFFERS FROM THE TARGET ALONE"
        print(line + "]" + ("" if pipe.draft_trained else "  (untrained random draft)"), file=sys.stderr)
    return 0
