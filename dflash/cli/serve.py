"""`dflash serve` and `dflash chat`: their parsers; the server and the chat load only when run."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

from dflash.cli.commands import (add_model_args, add_prompt_cache, add_spec_args, add_threads, deferred, set_threads,
                                 spec_from_args)
from dflash.serve.limits import PROMPT_CHARS_PER_TOKEN, Limits

API_KEY_ENV = "DFLASH_API_KEY"


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set ${API_KEY_ENV})")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the target's name)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 503 (default 64)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit, prompt + completion")
    p.add_argument("--max-batch", type=int, default=None,
                   help="requests decoded together, joining and leaving between steps (continuous batching); "
                        "1: one at a time (default: measured on this machine, 1 where the target's passes "
                        "cannot be shared)")
    add_spec_args(p)
    add_prompt_cache(p)
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown (default 30)")
    p.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes,
                   help=f"largest request body; larger gets 413 before it is read (default {Limits.max_body_bytes})")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help=f"longest prompt in characters, refused before tokenising "
                        f"(default: {PROMPT_CHARS_PER_TOKEN} x the context)")
    p.add_argument("--max-tokens-default", type=int, default=Limits.max_tokens_default,
                   help="max_tokens of a chat request that leaves it out (completions: OpenAI's 16, or this "
                        f"if smaller; default {Limits.max_tokens_default})")
    p.add_argument("--max-tokens-limit", type=int, default=Limits.max_tokens_limit,
                   help="a larger max_tokens is lowered to this; the answer then ends with finish_reason "
                        f"'length' (default {Limits.max_tokens_limit})")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a generation may run; then it ends with finish_reason 'length' (default: no limit)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (e.g. http://localhost:3000) whose pages may call the API from a browser; "
                        "repeat for more, '*' for any (default: none)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_threads(p)
    p.set_defaults(func=run_serve)

    c = sub.add_parser("chat", help="chat in the terminal, streaming, with tau and tokens/s shown live")
    add_model_args(c)
    c.add_argument("--system", default=None, help="a system message")
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--max-new-tokens", type=int, default=256)
    add_spec_args(c)
    add_prompt_cache(c)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--plain", action="store_true", help="no live status line (the default when not a terminal)")
    add_threads(c)
    c.set_defaults(func=_run_chat)


_run_chat = deferred("dflash.cli.chat:run_chat")


def run_serve(args) -> int:
    from dflash.serve.guard import is_loopback
    from dflash.serve.server import ServerOptions, build_server, default_name
    from dflash.text.pipeline import Pipeline

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(args.host) and api_key is None:
        print(f"warning: serving on {args.host} without an API key: anyone who can reach it can use it "
              f"(set --api-key or ${API_KEY_ENV})", file=sys.stderr)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    set_threads(args)
    spec = dataclasses.replace(spec_from_args(args), shared_suffix=args.proposer in ("suffix", "hybrid"))
    pipe = Pipeline.load(args.target, args.draft, kernels=getattr(args, "kernels", "auto"),
                         precision=getattr(args, "precision", "auto"), spec=spec)
    pipe = pipe.with_prompt_cache(args.prompt_cache_mb)
    name = args.model_name or default_name(args.target)
    limits = Limits(args.max_body_bytes, args.max_prompt_chars, args.max_tokens_default, args.max_tokens_limit,
                    args.request_timeout)
    options = ServerOptions(args.host, args.port, api_key, name, args.max_queue, args.max_model_len,
                            None, args.shutdown_grace, args.log_level, limits, tuple(args.allow_origin),
                            args.max_batch)
    server = build_server(pipe, options)
    print(f"dflash: serving '{name}' on http://{args.host}:{args.port}/v1 "
          f"(draft: {pipe.draft_path or 'random, untrained'}; up to {server.worker.max_batch} requests at once; "
          f"API key {'required' if api_key else 'off'})",
          file=sys.stderr)
    server.run()
    return 0
