"""Benchmark records and the statistics computed from them (pure functions, no models)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

from dflash.engine.stats import SpecStats, fold


@dataclass
class Record:
    """One method on one prompt. `steps` holds (proposed, accepted, committed) per verify
    step of a speculative method: draft tokens proposed, of which accepted, tokens committed
    (accepted + the recovered or bonus token, fewer when a stop token cut the step short).
    proposed = -1: the method does not say how many it proposed (HF prompt lookup). tau is
    the engine's one definition (engine/stats.py): tokens per verify step with proposals."""
    method: str
    output_ids: list[int]  # the new tokens only
    num_input_tokens: int
    total_time: float  # seconds, prefill included
    time_to_first_token: float
    steps: list[tuple[int, int, int]] = field(default_factory=list)
    finish_reason: str = "length"
    peak_memory_mb: float = 0.0  # peak resident memory while it ran, over the process before it
    prompt_id: str = ""
    dataset: str = ""
    text: str = ""
    extra: dict = field(default_factory=dict)  # method-specific counters (e.g. vLLM's)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def acceptance_lengths(self) -> list[int]:
        return [c for _, _, c in self.steps]

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.total_time if self.total_time > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["steps"] = [list(s) for s in self.steps]
        lengths = self.acceptance_lengths
        block = max([p + 1 for p, _, _ in self.steps] + lengths + [1])
        d.update(num_output_tokens=self.num_output_tokens, acceptance_lengths=lengths, tau=tau(self.steps),
                 tau_histogram=histogram(lengths, block) if lengths else [],
                 position_acceptance=per_position_acceptance(self.steps, block) if lengths else [],
                 tokens_per_s=round(self.tokens_per_s, 3))
        return d


def spec_stats(steps: list[tuple[int, int, int]]) -> SpecStats:
    """The engine's fold of (proposed, accepted, committed) steps. proposed = -1 (unknown, HF
    prompt lookup) counts as a verify step with proposals, `accepted` of them known."""
    return fold((max(a, 1) if p < 0 else p, a, c) for p, a, c in steps)


def tau(steps: list[tuple[int, int, int]]) -> float | None:
    """Mean acceptance length (vLLM's; engine/stats.py); None when no step had proposals."""
    stats = spec_stats(steps)
    return stats.mean_acceptance_length if stats.num_drafts else None


def histogram(acceptance_lengths: list[int], block_size: int) -> list[int]:
    """counts[i] = steps that committed i+1 tokens, i = 0..block_size-1."""
    c = Counter(acceptance_lengths)
    return [c.get(i, 0) for i in range(1, block_size + 1)]


def per_position_acceptance(steps: list[tuple[int, int, int]], block_size: int) -> list[float | None]:
    """rate[k-1] = P(draft position k accepted | position k was proposed), k = 1..B-1 (not
    conditioned on earlier positions: the share of drafts reaching k, as vLLM counts it)."""
    offered, accepted = [0] * (block_size - 1), [0] * (block_size - 1)
    for p, a, _ in steps:
        for k in range(min(p, block_size - 1)):  # p = -1 (unknown) counts nowhere
            offered[k] += 1
            accepted[k] += k < a
    return [a / o if o else None for a, o in zip(accepted, offered)]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def paired_speedups(records: list[Record], method: str, baseline: str) -> dict[str, float]:
    """(dataset, prompt_id) -> method tokens/s over baseline tokens/s, for prompts both ran
    (at temperature 0 the outputs are equal, so this is also the time ratio)."""
    by = {(r.method, r.dataset, r.prompt_id): r for r in records}
    out = {}
    for (m, ds, pid), r in by.items():
        b = by.get((baseline, ds, pid))
        if m == method and b is not None and r.total_time > 0 and b.num_output_tokens and r.num_output_tokens:
            out[(ds, pid)] = (b.total_time / b.num_output_tokens) / (r.total_time / r.num_output_tokens)
    return out


@dataclass
class Summary:
    """One method on one dataset (or "all")."""
    dataset: str
    method: str
    prompts: int
    tokens: int
    tau: float | None
    tau_histogram: list[int]
    position_acceptance: list[float | None]
    tokens_per_s: float | None  # median over prompts
    ttft_ms: float | None  # median
    speedup: float | None  # ratio of median tokens/s against the baseline, same prompts
    speedup_paired_median: float | None  # median of the per-prompt ratios
    peak_memory_mb: float | None  # max over prompts
    verified_per_step: float | None = None  # mean tokens a verify pass checks (1 + proposals: a tree's nodes)
    source_share: dict = field(default_factory=dict)  # share of accepted proposals per source
    speedup_vs_loop: float | None = None  # as `speedup`, against our own loop at block 1 (what speculation adds)
    tokens_per_pass: float | None = None  # tokens per target pass after the prefill, plain steps included
    plain_share: float | None = None  # share of those passes that verified no proposal
    draft_share: float | None = None  # share of those passes for which the draft model ran (None: not counted)

    def to_dict(self) -> dict:
        return asdict(self)


def _median_speedup(rs: list[Record], base: dict) -> float | None:
    """Median tokens/s of `rs` over the median of their prompts' `base` records."""
    paired = [r for r in rs if (r.dataset, r.prompt_id) in base]
    if not paired:
        return None
    m_tps = median([r.tokens_per_s for r in paired])
    b_tps = median([base[r.dataset, r.prompt_id].tokens_per_s for r in paired])
    return m_tps / b_tps if m_tps and b_tps else None


def summarize(records: list[Record], dataset: str, method: str, baseline: str, block_size: int,
              loop_baseline: str | None = "loop-b1") -> Summary:
    rs = [r for r in records if r.method == method and (dataset == "all" or r.dataset == dataset)]
    base = {(r.dataset, r.prompt_id): r for r in records
            if r.method == baseline and (dataset == "all" or r.dataset == dataset)}
    loop = {(r.dataset, r.prompt_id): r for r in records
            if r.method == loop_baseline and (dataset == "all" or r.dataset == dataset)}
    steps = [s for r in rs for s in r.steps]
    lengths = [c for _, _, c in steps]
    speedup = _median_speedup(rs, base)
    ratios = paired_speedups(rs + list(base.values()), method, baseline)
    stats = spec_stats(steps)
    verified = 1 + stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else None
    by_source: dict[str, int] = {}
    for r in rs:
        for s, c in (r.extra or {}).get("accepted_per_source", {}).items():
            by_source[s] = by_source.get(s, 0) + c
    share = {s: round(c / max(sum(by_source.values()), 1), 3) for s, c in sorted(by_source.items())}
    counted = [r for r in rs if "draft_passes" in (r.extra or {})]
    drafted = sum(r.extra["draft_passes"] for r in counted) / max(sum(len(r.steps) for r in counted), 1)
    return Summary(dataset, method, len(rs), sum(r.num_output_tokens for r in rs), tau(steps),
                   histogram(lengths, block_size), per_position_acceptance(steps, block_size),
                   median([r.tokens_per_s for r in rs]), _ms(median([r.time_to_first_token for r in rs])),
                   speedup, median(list(ratios.values())), max((r.peak_memory_mb for r in rs), default=None),
                   verified, share, _median_speedup(rs, loop) if method != baseline else None,
                   sum(lengths) / len(steps) if steps else _reported_tokens_per_pass(rs),
                   stats.num_plain_steps / len(steps) if steps else None, drafted if counted else None)


def _reported_tokens_per_pass(rs: list[Record]) -> float | None:
    """Tokens per target pass after the prefill from an engine's own counters
    (`extra["target_passes"]`, e.g. llama.cpp's timings), when it reports no steps."""
    counted = [r for r in rs if (r.extra or {}).get("target_passes")]
    passes = sum(r.extra["target_passes"] for r in counted)
    return sum(r.num_output_tokens - 1 for r in counted) / passes if passes else None


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def first_mismatch(reference: list[int], other: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None when equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def expected_commits(rates: list[float | None], block_size: int) -> float:
    """Tokens one step commits at `block_size`, from unconditional per-position acceptance
    measured at a block at least as large: 1 (the recovered or bonus token) + sum of P(k accepted)."""
    return 1.0 + sum(r or 0.0 for r in rates[: block_size - 1])


def predicted_speedup(rates: list[float | None], block_size: int, target_ms: dict[int, float],
                      draft_ms: dict[int, float], rest_head_ms: dict[int, float] | None = None) -> float | None:
    """tau(B) * T_target(1) / (T_target(B) + P(proposal 1 accepted) * T_rest_head(B) + T_draft(B)),
    host work left out: the verify pass's lm_head covers rows 2..B only when proposal 1 is accepted."""
    if block_size not in target_ms or (block_size > 1 and block_size not in draft_ms):
        return None
    step = target_ms[block_size]
    if block_size > 1:
        step += draft_ms[block_size] + (rates[0] or 0.0) * (rest_head_ms or {}).get(block_size, 0.0)
    return expected_commits(rates, block_size) * target_ms[1] / step
