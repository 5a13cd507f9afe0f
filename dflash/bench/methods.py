"""The methods `dflash bench` compares, behind one registry.

A method is a callable `(pipeline, input_ids (1, T), max_new_tokens) -> Record`. Providers
turn the run's settings into methods, `fn(settings) -> list[(name, method)]`, listed in
`PROVIDERS` at the end of this file; a provider that cannot run here returns [] and says why
in `settings.notes` (the vLLM provider does, until vLLM is installed)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dflash.bench.stats import Record
from dflash.engine.loop import DraftHead, DraftProposer, open_row, run_row
from dflash.engine.sampling import SamplingParams
from dflash.engine.stats import SpecStats
from dflash.text.pipeline import SpecSettings

BASELINE = "target"  # the target alone through HF generate: every speedup is against it

Method = Callable[..., Record]


@dataclass
class Settings:
    block_sizes: tuple[int, ...] = (16,)
    temperature: float = 0.0
    seed: int = 0
    prompt_lookup: int = 10  # prompt_lookup_num_tokens; 0 leaves the peer out
    loop_baseline: bool = True  # our loop at block size 1
    draft_vocabs: tuple[int, ...] = ()  # what-if: a draft vocabulary of K frequent ids (largest block)
    vocab_source: Callable | None = None  # (pipeline, K) -> ids; None: frequent_vocabulary
    draft_thresholds: tuple[float, ...] = ()  # also the largest block verifying only proposals with draft prob >= P
    proposers: tuple[str, ...] = ()  # also these proposers at the largest block: "tree", "suffix", "hybrid"
    adaptive: bool = False  # also the draft's chain at the largest block with the adaptive verify policy
    plain_vocab: bool = False  # also the draft's chain at the largest block without the context vocabulary
    cost_source: Callable | None = None  # pipeline -> its CostModel (sizes trees); None: measured and cached
    compare_drafts: tuple[str, ...] = ()  # also every draft method with each of these draft checkpoints
    compare_kernels: tuple[str, ...] = ()  # also every draft method with each of these kernel settings
    compare_precisions: tuple[str, ...] = ()  # also every loop method with the target at each of these precisions
    llamacpp: bool = False  # also llama.cpp's methods (bench/llamacpp.py)
    llamacpp_target: str | None = None  # the target's GGUF for them (default: the default target's)
    llamacpp_draft_max: int | None = None  # llama.cpp's --spec-draft-n-max (default: block size - 1)
    llamacpp_threads: int = 2
    notes: list[str] = field(default_factory=list)  # lines for the user (e.g. what was skipped)

    def __post_init__(self):
        if self.vocab_source is None:
            self.vocab_source = frequent_vocabulary


def build_methods(settings: Settings) -> list[tuple[str, Method]]:
    """All methods of all providers, the baseline first; names are unique."""
    methods = [m for provider in PROVIDERS for m in provider(settings)]
    names = [n for n, _ in methods]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"two benchmark methods share the name(s) {dupes}")
    return methods


class PeakMemory:
    """Peak resident set size of this process while the block runs, sampled every few ms
    from /proc (CPU); on CUDA, torch's peak allocated memory. `.mb` is over the start."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.mb = interval, 0.0
        self._stop = threading.Event()

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
            return self
        self._start = self._peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, rss_bytes())

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            self.mb = (torch.cuda.max_memory_allocated() - self._start) / 2**20
            return
        self._stop.set()
        self._thread.join()
        self.mb = (max(self._peak, rss_bytes()) - self._start) / 2**20


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


# ---- our loop ------------------------------------------------------------------------
def loop_method(block_size: int, settings: Settings, draft_vocab: int | None = None, threshold: float = 0.0,
                proposer_kind: str | None = None, adaptive: bool = False, context_vocab: bool = True) -> Method:
    """dflash's loop at `block_size` (1: plain target decoding through the same loop), with the
    draft's chain or another proposer (`proposer_kind`, sized by the machine's cost model).
    `context_vocab=False`: the chain's head keeps the draft vocabulary as shipped, not widened
    by the ids of the prompt and the answer (`DraftHead.widened`)."""
    vocab: dict[int, list[int]] = {}  # the draft vocabulary per pipeline, built on first use
    views: dict[int, object] = {}  # per pipeline: itself, or a view on the settings' cost model
    spec = SpecSettings(block_size, threshold, proposer_kind or "draft", "adaptive" if adaptive else "fixed")

    def run(pipe, input_ids, max_new_tokens) -> Record:
        gen = torch.Generator().manual_seed(settings.seed) if settings.temperature > 0 else None
        params = SamplingParams(settings.temperature)
        if id(pipe) not in views:
            views[id(pipe)] = pipe if settings.cost_source is None else pipe.with_cost_model(settings.cost_source(pipe))
        view = views[id(pipe)]
        head = None  # what-if heads of the draft's chain; else the pipeline builds proposer and policy
        if draft_vocab and block_size > 1:  # the draft proposes from the K most frequent ids only
            if id(pipe) not in vocab:
                vocab[id(pipe)] = settings.vocab_source(pipe, draft_vocab)
            head = {"head": DraftHead.of(vocab[id(pipe)], pipe.target)}
        elif not context_vocab and block_size > 1:
            head = {"context_vocab": False}

        def opened():  # the request's row (its cache allocated), timed with the request as the loop does
            if head is None:
                return view.open_row(input_ids, max_new_tokens, params, gen, spec)
            proposer = DraftProposer(pipe.draft, pipe.target, params, pipe.draft.config.mask_token_id, gen,
                                     layout=pipe.draft_layout(), **head)
            return open_row(pipe.draft, pipe.target, input_ids, max_new_tokens, stop_token_ids=pipe.stop_token_ids,
                            params=params, block_size=block_size, generator=gen, draft_threshold=threshold,
                            proposer=proposer)

        tokens, steps, ttft, finish, stats = [], [], 0.0, "length", SpecStats()
        with PeakMemory() as mem:
            start = time.perf_counter()
            for i, step in enumerate(run_row(opened(), input_ids)):
                if i == 0:
                    ttft = time.perf_counter() - start
                else:
                    steps.append((step.proposed, step.accepted, len(step.tokens)))
                    stats.add_step(step)
                tokens += step.tokens
                finish = step.finish_reason or finish
            total = time.perf_counter() - start
        extra = {"accepted_per_source": stats.num_accepted_tokens_per_source,
                 "draft_passes": stats.num_draft_passes} if stats.num_drafts else {}
        if pipe.target.precision != "fp32":  # below fp32 the reference is plain decoding at that precision
            extra["exact_against"] = _loop_name(1)
        name = _loop_name(block_size) if proposer_kind is None else _proposer_name(proposer_kind, block_size)
        name += ("-adaptive" if adaptive else "") + ("" if context_vocab else "-plainvocab")
        return Record(name, tokens, input_ids.shape[1], total, ttft, steps, finish, mem.mb, extra=extra)

    return run


def frequent_vocabulary(pipe, size: int) -> list[int]:
    """The `size` most frequent ids of the ShareGPT train prompts (plus the stop tokens),
    as `python -m dflash.text.vocab` writes them into a checkpoint."""
    from dflash.text.prompts import sharegpt
    from dflash.text.vocab import frequent_ids

    return frequent_ids(pipe.tokenizer, [p.content for p in sharegpt(split="train")], size, always=pipe.stop_token_ids)


def _loop_name(block_size: int) -> str:
    return "loop-b1" if block_size == 1 else f"dflash-b{block_size}"


def _proposer_name(kind: str, block_size: int) -> str:
    return {"tree": "dflash-tree", "suffix": "suffix", "hybrid": "hybrid"}[kind] + f"-b{block_size}"


# ---- HF generate: the target alone, and prompt lookup --------------------------------
class _TimingStreamer:
    """Records when generate pushes tokens: the first push is the prompt, then one push per
    step (several tokens per step for assisted/prompt-lookup decoding)."""

    def __init__(self):
        self.pushes: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.pushes.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


def hf_method(name: str, settings: Settings, **generate_kwargs) -> Method:
    def run(pipe, input_ids, max_new_tokens) -> Record:
        from transformers import GenerationConfig

        model, tok = pipe.target.model, pipe.tokenizer
        sampled = settings.temperature > 0
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sampled,
                               temperature=settings.temperature if sampled else None, top_k=0 if sampled else None,
                               top_p=1.0 if sampled else None, eos_token_id=pipe.stop_token_ids,
                               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else pipe.stop_token_ids[0],
                               **generate_kwargs)
        if sampled:
            torch.manual_seed(settings.seed)
        streamer = _TimingStreamer()
        with PeakMemory() as mem, torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=cfg,
                                 streamer=streamer)
            total = time.perf_counter() - start
        tokens = out[0, input_ids.shape[1]:].tolist()
        pushes = streamer.pushes
        ttft = pushes[0][0] - start if pushes else total
        proposed = -1 if "prompt_lookup_num_tokens" in generate_kwargs else 0
        steps = [(proposed, n - 1, n) for _, n in pushes[1:]] if proposed else []
        finish = "stop" if tokens and tokens[-1] in pipe.stop_token_ids else "length"
        return Record(name, tokens, input_ids.shape[1], total, ttft, steps, finish, mem.mb)

    return run


def _hf_methods(settings: Settings):
    methods = [(BASELINE, hf_method(BASELINE, settings))]
    if settings.prompt_lookup:
        name = f"prompt-lookup-{settings.prompt_lookup}"
        methods.append((name, hf_method(name, settings, prompt_lookup_num_tokens=settings.prompt_lookup)))
    return methods


def _loop_methods(settings: Settings):
    sizes = ([1] if settings.loop_baseline else []) + [b for b in settings.block_sizes if b > 1]
    methods = [(_loop_name(b), loop_method(b, settings)) for b in dict.fromkeys(sizes)]
    top = max(settings.block_sizes)
    if top > 1:
        methods += [(f"{_loop_name(top)}-v{k}", loop_method(top, settings, k)) for k in settings.draft_vocabs]
        methods += [(f"{_loop_name(top)}-t{p:g}", loop_method(top, settings, threshold=p)) for p in settings.draft_thresholds]
        if settings.adaptive:
            methods.append((f"{_loop_name(top)}-adaptive", loop_method(top, settings, adaptive=True)))
        if settings.plain_vocab:
            methods.append((f"{_loop_name(top)}-plainvocab", loop_method(top, settings, context_vocab=False)))
        methods += [(_proposer_name(k, top), loop_method(top, settings, proposer_kind=k)) for k in settings.proposers]
    return methods


def _compared_methods(settings: Settings):
    """Every method of `_loop_methods` that runs the draft, once more per variant: per draft
    checkpoint of `settings.compare_drafts` (named `<method>@<checkpoint>`, `Pipeline.with_draft`)
    and per kernel setting of `settings.compare_kernels` (named `<method>@kernels=<mode>`,
    `Pipeline.with_kernels`), and per target precision of `settings.compare_precisions` (named
    `<method>@precision=<p>`, `Pipeline.with_precision`; the plain loop and n-gram methods too,
    as the precision changes them). Each variant is one view of the pipeline (its own cost model and
    tree states) on the same loaded model, so both sides run in one process on the same
    prompts, interleaved prompt by prompt, and a drift of the machine's speed during the run
    falls on both alike."""
    variants = [(path, f"compared draft: {path}", lambda pipe, p=path: pipe.with_draft(p), False)
                for path in settings.compare_drafts]
    variants += [(f"kernels={mode}", f"compared kernel setting: {mode}", lambda pipe, m=mode: pipe.with_kernels(m),
                  False) for mode in settings.compare_kernels]
    variants += [(f"precision={p}", f"compared target precision: {p}", lambda pipe, p=p: pipe.with_precision(p), True)
                 for p in settings.compare_precisions]
    out = []
    for tag, note, build, every in variants:
        settings.notes.append(f"{note} (its methods are named METHOD@{tag})")
        views: dict[int, object] = {}  # id(main pipeline) -> its view

        def view(pipe, build=build, views=views):
            if id(pipe) not in views:
                views[id(pipe)] = build(pipe)
            return views[id(pipe)]

        for name, method in _loop_methods(settings):  # fresh closures: their per-pipeline caches are the view's
            if not every and (name == _loop_name(1) or name.startswith("suffix-")):  # no draft in them
                continue
            out.append((f"{name}@{tag}", lambda pipe, ids, n, m=method, view=view, tag=tag: _tagged(m(view(pipe), ids, n), tag)))
    return out


def _tagged(rec: Record, tag: str) -> Record:
    """A variant's record: its reference for exactness is the variant's own (plain decoding at
    the variant's precision), when it names one."""
    if rec.extra and "exact_against" in rec.extra:
        rec.extra["exact_against"] += f"@{tag}"
    return rec


def _vllm_methods(settings: Settings):
    """vLLM's plain decoding and vLLM + our draft, run in vLLM's own venv (dflash.vllm_backend);
    opt-in with DFLASH_BENCH_VLLM=1 since each engine takes minutes to start."""
    from dflash.bench.vllm import bench_methods, wanted

    if not wanted(settings):
        settings.notes.append("vLLM methods are off (set DFLASH_BENCH_VLLM=1; needs scripts/vllm_env.sh)")
        return []
    return bench_methods(settings)


def _llamacpp_methods(settings: Settings):
    """llama.cpp's plain decoding, its n-gram proposer and our draft in it, through llama-server
    (bench/llamacpp.py); opt-in, since llama-server is built once per machine."""
    from dflash.bench.llamacpp import bench_methods

    return bench_methods(settings)


# every provider, in the order their methods are listed (the baseline's first)
PROVIDERS: tuple[Callable[[Settings], list[tuple[str, Method]]], ...] = (
    _hf_methods, _loop_methods, _compared_methods, _vllm_methods, _llamacpp_methods)
