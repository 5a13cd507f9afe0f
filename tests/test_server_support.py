"""Helpers for the server and chat tests: a tiny random pipeline (no downloads, no 135M
model) and a live server on a loopback port, run in a thread."""

from __future__ import annotations

import socket
import threading
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dflash.engine.config import DFlashConfig
from dflash.engine.draft import DFlashDraftModel
from dflash.engine.target import TargetModel
from dflash.text.pipeline import Pipeline

SPECIALS = ["<|unused|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts a block of tokens",
          "the target verifies every draft token in one pass", "hello world, how are you today?",
          "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe", "\u65e5\u672c\u8a9e \u4e2d\u6587 \U0001f600"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (so any text encodes, and bytes can split characters) trained here."""
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


def tiny_pipeline(seed: int = 0, block_size: int = 4, max_positions: int = 256, perfect: bool = False) -> Pipeline:
    """A random 2-layer Llama target and a random 1-layer draft. perfect=True zeroes the
    target's lm_head, so target and draft both always pick token 0 (a non-stop special):
    every draft token is accepted, which exercises the acceptance counters.

    Tiny models run fastest on one thread, and the test machine's cores are shared."""
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


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class LiveServer:
    """`dflash serve`'s app on 127.0.0.1:<free port>, in a background thread."""

    def __init__(self, pipe: Pipeline, start_worker: bool = True, **options):
        from dflash.serve.server import ServerOptions, build_server

        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = build_server(pipe, ServerOptions(port=self.port, **options), start_worker=start_worker)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def worker(self):
        return self.server.worker

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 20) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __exit__(self, *exc) -> None:
        self.stop()
