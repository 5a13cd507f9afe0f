"""Plain decoding of the default target three ways on this CPU: llama.cpp on the shipped GGUF
(the speed a user could have instead), HF `generate`, and our loop at block 1 (both settings
of --kernels), on the same prompt tokens, greedy, rounds interleaved.

    pip install llama-cpp-python          # builds llama.cpp from source: minutes (see below)
    python benchmarks/cpu/llamacpp.py --threads 2 --rounds 3 --max-new-tokens 128 [--out FILE.json]

Run it on a quiet machine: every figure is a wall-clock median over the rounds. llama.cpp
runs the GGUF's own Q4_1 weights (4-bit: a quarter of the bytes per weight that fp32 reads),
while HF and our loop run the fp32 weights dequantised from that file (dflash/text/assets.py),
so this is the speed gap a user sees, not a like-for-like kernel comparison. Without
llama-cpp-python installed, its row is left out (the script says so)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PROMPT = "Write a Python function that checks whether a number is prime."  # `make demo`'s


def run_llamacpp(gguf: Path, ids: list[int], max_new: int, threads: int, stop: set[int]):
    """One greedy generation: (new token ids, time to first token s, total s)."""
    import llama_cpp

    llm = run_llamacpp.cache.get(threads)
    if llm is None:
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                              n_batch=512, verbose=False)
        run_llamacpp.cache[threads] = llm
    llm.reset()
    out, start, ttft = [], time.perf_counter(), None
    for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if ttft is None:
            ttft = time.perf_counter() - start
        out.append(int(tok))
        if tok in stop or len(out) >= max_new:
            break
    return out, ttft, time.perf_counter() - start


run_llamacpp.cache = {}


def run_hf(model, ids, max_new: int, stop: list[int], pad: int):
    import torch

    x = torch.tensor([ids])
    start = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=stop, pad_token_id=pad)
    return out[0, len(ids):].tolist(), None, time.perf_counter() - start


def run_loop(target, ids, max_new: int, stop: list[int]):
    import torch

    from dflash.engine.loop import dflash_generate

    res = dflash_generate(None, target, torch.tensor([ids]), max_new, stop, block_size=1, return_stats=True)
    return res.output_ids[0, len(ids):].tolist(), res.time_to_first_token, res.total_time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    args = ap.parse_args()

    import torch

    from dflash.bench.machine import machine_info
    from dflash.engine.target import TargetModel
    from dflash.text.assets import find_smollm2_gguf
    from dflash.text.pipeline import Pipeline

    torch.set_num_threads(args.threads)
    pipe = Pipeline.load(None, "random", quiet=True)  # the draft is not used: block 1
    ids = pipe.encode_chat([{"role": "user", "content": args.prompt}])[0].tolist()
    stop = list(pipe.stop_token_ids)
    methods = {"hf-generate": lambda: run_hf(pipe.target.model, ids, args.max_new_tokens, stop,
                                             pipe.tokenizer.pad_token_id),
               "loop-b1 (kernels=auto)": lambda: run_loop(pipe.target, ids, args.max_new_tokens, stop),
               "loop-b1 (kernels=torch)": (lambda t: lambda: run_loop(t, ids, args.max_new_tokens, stop))(
                   TargetModel(pipe.target.model, kernels="torch"))}
    notes = []
    try:
        import llama_cpp  # noqa: F401

        gguf = find_smollm2_gguf()
        methods["llama.cpp (Q4_1 GGUF)"] = lambda: run_llamacpp(gguf, ids, args.max_new_tokens, args.threads, set(stop))
    except ImportError:
        notes.append("llama-cpp-python is not installed (pip install llama-cpp-python): its row is left out")
        print(notes[-1], file=sys.stderr)
    for fn in methods.values():  # warm-up: one short run each (llama.cpp loads its model here)
        fn()
    runs = {name: [] for name in methods}
    names = list(methods)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # the order rotates
            runs[name].append(methods[name]())
            out, ttft, total = runs[name][-1]
            print(f"round {r + 1} {name}: {len(out)} tokens in {total:.2f} s ({len(out) / total:.1f} tok/s)",
                  file=sys.stderr)
    ref = runs["hf-generate"][0][0]
    rows = []
    for name, rs in runs.items():
        tps = statistics.median(len(o) / t for o, _, t in rs)
        rows.append({"method": name, "tokens": len(rs[0][0]), "tokens_per_s": round(tps, 2),
                     "ttft_ms": None if rs[0][1] is None else round(statistics.median(x[1] for x in rs) * 1e3, 1),
                     "same_tokens_as_hf": rs[0][0] == ref})
    base = next(r["tokens_per_s"] for r in rows if r["method"] == "hf-generate")
    print(f"\n{args.max_new_tokens} new tokens at most, {args.threads} threads, median of {args.rounds} rounds")
    print("| method | tokens | tok/s | vs HF generate | TTFT ms | same tokens as HF |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['tokens']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{'-' if r['ttft_ms'] is None else r['ttft_ms']} | {'yes' if r['same_tokens_as_hf'] else 'no'} |")
    if args.out:
        info = {"machine": machine_info(pipe.target.kernel_info()), "settings": vars(args), "rows": rows, "notes": notes}
        Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
