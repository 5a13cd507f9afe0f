"""A batched generator for regenerating training responses with the target: left padding,
one forward per step with no per-step processors, and the chosen layers' hidden states of
every real token (prompt and response) captured on the way, so training never re-runs the
target."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

import torch

from dflash.engine import static_decoder


FP16_MAX = 65504.0


def fp16_features(x: torch.Tensor) -> torch.Tensor:
    """Target features as stored (fp16), clamped to fp16's finite range: Gemma 3's residual stream
    reaches ~1e5 at <bos>, which a plain cast turns into inf and training into NaN."""
    return x.clamp(-FP16_MAX, FP16_MAX).half()


@dataclass
class Generated:
    prompt_ids: list[int]
    response_ids: list[int]  # stops after (and includes) the first stop token
    features: torch.Tensor  # (len(prompt)+len(response)-1, k*H) fp16: hidden of every token fed to the target
    finished: bool  # True when a stop token ended it
    label_ids: list[int] | None = None  # the target's token at each position, when it differs from the tokens
    soft: SoftLabels | None = None  # the target's distribution over each response token


@dataclass
class SoftLabels:
    """The target's next-token distribution at R positions, kept as its top k: ids (R, k)
    int32, their log-probabilities (R, k) fp16, and the log of the remaining mass (R,) fp16."""
    ids: torch.Tensor  # (R, k) int32
    logprobs: torch.Tensor  # (R, k) fp16
    rest: torch.Tensor  # (R,) fp16

    @classmethod
    def from_logits(cls, logits: torch.Tensor, k: int) -> SoftLabels:
        """logits (R, V) -> the top k of their softmax and the log of what is left."""
        lp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
        top, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)  # (R, k)
        rest = torch.log((1.0 - top.exp().sum(-1)).clamp(min=1e-10))  # (R,)
        return cls(ids.int().cpu(), top.half().cpu(), rest.half().cpu())

    @classmethod
    def cat(cls, parts: list[SoftLabels]) -> SoftLabels:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("ids", "logprobs", "rest")))

    def __len__(self) -> int:
        return self.ids.shape[0]


def _cache_kwargs(model, cache) -> dict:
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


@dataclass
class Request:
    """One prompt to answer: its tokens, its own response limit, and the caller's handle."""
    prompt: list[int]
    max_new_tokens: int
    key: object = None


class _HFSteps:
    """HF's own forward on a DynamicCache (any model). It cannot take a new row into a running
    batch: a batch is admitted whole, and the next one starts when its last row has ended."""
    refills = False

    def __init__(self, model, layer_ids: list[int], batch: int, longest_prompt: int, longest_response: int,
                 pad_id: int):
        self.model, self.layer_ids, self.pad_id = model, layer_ids, pad_id
        self.cache, self.mask = None, None  # mask: (B, T) long, 0 at padding

    def compact_at(self, batch: int) -> int:
        return 1  # dropping a row from a DynamicCache is as cheap as its next concatenation

    def admit(self, rows: list[int], prompts: list[list[int]]):
        """The whole batch, left padded: (B, V) logits and each row's (n_i, k*H) prompt features."""
        from transformers import DynamicCache

        dev = self.model.get_input_embeddings().weight.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=dev)  # (B, T) left padded
        self.mask = torch.zeros_like(ids)  # (B, T)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, device=dev)
            self.mask[i, width - len(p):] = 1
        self.cache = DynamicCache(config=self.model.config)
        logits, feats = self(ids, (self.mask.cumsum(-1) - 1).clamp(min=0))  # (B, V), (B, T, k*H)
        return logits, [feats[i, width - len(p):] for i, p in enumerate(prompts)]

    def __call__(self, ids, positions):
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                         output_hidden_states=True, logits_to_keep=1, **_cache_kwargs(self.model, self.cache))
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)  # (A, T+1) for the next token
        return out.logits[:, -1], torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    def release(self, rows: list[int]) -> None:
        pass  # a finished row waits for the next compaction

    def select(self, rows):
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]


class _StaticSteps:
    """The lean forward of `static_decoder` on a preallocated KV buffer (Llama family), refilled
    as rows end: a new prompt's K/V are written to end at the buffer's current length (every
    row writes its next token at that slot), its row's older slots masked off. Once the oldest
    live row leaves `SLACK` free slots at the front, the buffer shifts them out, so attention
    reads about as many slots as the oldest live row holds, however long the stream."""
    refills = True
    SLACK = 64  # a shift copies the filled buffer: do it at most once per this many steps

    def __init__(self, model, layer_ids: list[int], batch: int, longest_prompt: int, longest_response: int,
                 pad_id: int):
        self.model, self.layer_ids, self.room = model, layer_ids, longest_prompt
        size = longest_prompt + longest_response + self.SLACK
        self.kv = static_decoder.KVBuffer(model, batch, size)
        self.kv.length = longest_prompt  # a prompt ends at the buffer's length: leave room for the longest
        dev = self.kv.k.device
        self.valid = torch.ones(batch, size, dtype=torch.bool, device=dev)  # (B, S) False before a row's first slot
        self.start = torch.full((batch,), size, device=dev)  # (B,) first slot of each row; free rows: the end
        self.head = model.get_output_embeddings()

    def compact_at(self, batch: int) -> int:
        return max(1, batch // 4)  # a compaction copies the buffer: wait for a quarter of the rows

    def admit(self, rows: list[int], prompts: list[list[int]]):
        """Each prompt alone, without padding, its K/V then placed at its row's slots: (R, V)
        logits and each row's (n_i, k*H) prompt features."""
        end, dev = self.kv.length, self.kv.k.device
        logits, feats = [], []
        for i, p in zip(rows, prompts):
            n = len(p)
            one = static_decoder.KVBuffer(self.model, 1, n)
            final, f = static_decoder.forward(self.model, torch.tensor([p], device=dev),
                                              torch.arange(n, device=dev)[None], one, None,
                                              self.layer_ids)  # (1, n, H), (1, n, k*H)
            self.kv.k[:, i, :, end - n:end], self.kv.v[:, i, :, end - n:end] = one.k[:, 0], one.v[:, 0]
            self.valid[i], self.valid[i, :end - n], self.start[i] = True, False, end - n
            logits.append(self.head(final[0, -1]))
            feats.append(f[0])
        return torch.stack(logits), feats

    def __call__(self, ids, positions):
        self._shift()
        end = self.kv.length + ids.shape[1]
        final, feats = static_decoder.forward(self.model, ids, positions, self.kv, self.valid[:, :end], self.layer_ids)
        return self.head(final[:, -1]), feats  # (A, V), (A, T, k*H)

    def release(self, rows: list[int]) -> None:
        """Rows that ended no longer hold the front of the buffer (they keep attending their
        old slots, finite numbers nobody reads, until refilled)."""
        self.start[rows] = self.kv.max_len

    def _shift(self) -> None:
        """Drop the slots before every live row's first, keeping room for the longest prompt."""
        amount = min(int(self.start.min()), self.kv.length - self.room)
        if amount < self.SLACK and self.kv.length < self.kv.max_len:
            return
        self.kv.shift(amount)
        self.valid = torch.cat([self.valid[:, amount:], self.valid.new_ones(len(self.valid), amount)], dim=1)
        self.start = torch.where(self.start < self.kv.max_len, self.start - amount, self.start)

    def select(self, rows):
        self.kv.select(rows)
        self.valid, self.start = self.valid[rows], self.start[rows]


class _Rows:
    """What each row of a generating batch holds: its request (None: free), the tokens it has
    produced, the features of every token it fed the target, and its soft labels."""

    def __init__(self, size: int, longest_prompt: int, longest_response: int, feat_dim: int, topk: int,
                 stop: torch.Tensor):
        dev = stop.device
        self.req: list[Request | None] = [None] * size
        self.live = torch.zeros(size, dtype=torch.bool, device=dev)  # (A,) generating
        self.tokens = torch.zeros(size, longest_response, dtype=torch.long, device=dev)  # (A, N)
        self.count = torch.zeros(size, dtype=torch.long, device=dev)  # (A,) tokens produced
        self.limit = torch.ones(size, dtype=torch.long, device=dev)  # (A,) each row's max_new_tokens
        self.nxt = torch.zeros(size, dtype=torch.long, device=dev)  # (A,) the token each row feeds next
        self.pos = torch.zeros(size, dtype=torch.long, device=dev)  # (A,) its position
        self.fill = torch.zeros(size, dtype=torch.long, device=dev)  # (A,) feature rows captured
        self.feats = torch.zeros(size, longest_prompt + longest_response - 1, feat_dim, dtype=torch.float16,
                                 device=dev)  # (A, P+N-1, k*H)
        self.soft = _SoftBuffer(size, longest_response, topk) if topk > 0 else None
        self.topk, self.stop = topk, stop

    def begin(self, i: int, req: Request, feats: torch.Tensor) -> None:
        n = len(req.prompt)
        self.req[i], self.live[i], self.count[i], self.limit[i] = req, True, 0, req.max_new_tokens
        self.feats[i, :n], self.fill[i], self.pos[i] = fp16_features(feats), n, n

    def capture(self, feats: torch.Tensor) -> None:
        """feats (A, 1, k*H): the step's features of the live rows' fed tokens."""
        idx = self.live.nonzero()[:, 0]  # (R,)
        self.feats[idx, self.fill[idx]] = fp16_features(feats[idx, 0])
        self.fill[idx] += 1
        self.pos[idx] += 1

    def take(self, idx: torch.Tensor, logits: torch.Tensor, temperature: float, generator) -> list[int]:
        """Choose the next token of rows idx (R,) from their logits (R, V); the rows that ended."""
        logits = logits.float()
        if self.soft is not None:
            self.soft.put(idx.cpu(), self.count[idx].cpu(), SoftLabels.from_logits(logits, self.topk))
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]  # (R,)
        else:
            nxt = logits.argmax(-1)  # (R,)
        self.tokens[idx, self.count[idx]] = nxt
        self.count[idx] += 1
        self.nxt[idx] = nxt
        ends = torch.isin(nxt, self.stop) | (self.count[idx] >= self.limit[idx])  # (R,)
        return idx[ends].tolist()

    def finish(self, i: int) -> tuple[Request, Generated]:
        """Row i's request and what it produced; the row is free again."""
        req, n = self.req[i], int(self.count[i])
        resp = self.tokens[i, :n].tolist()
        g = Generated(req.prompt, resp, self.feats[i, :int(self.fill[i])].cpu().clone(),
                      bool(torch.isin(self.tokens[i, n - 1], self.stop)),
                      soft=self.soft.row(i, n) if self.soft is not None else None)
        self.req[i], self.live[i] = None, False
        return req, g

    def select(self, rows: torch.Tensor) -> None:
        self.req = [self.req[i] for i in rows.tolist()]
        for name in ("live", "tokens", "count", "limit", "nxt", "pos", "fill", "feats"):
            setattr(self, name, getattr(self, name)[rows])
        if self.soft is not None:
            self.soft.select(rows.cpu())


@torch.inference_mode()
def generate_stream(model, requests: Iterable[Request], layer_ids: list[int], stop_ids: list[int], pad_id: int,
                    *, batch: int, longest_prompt: int, longest_response: int, temperature: float = 0.0,
                    generator: torch.Generator | None = None, static: bool | None = None,
                    topk: int = 0) -> Iterator[tuple[Request, Generated]]:
    """Answer a stream of requests, up to `batch` at a time, yielding each (request, result)
    as its row ends (at a stop token or its own limit): not in the order given. With the
    static forward a row that ends takes the next request at once, so the batch stays full
    until the stream runs dry; HF's forward runs batch after batch. Every prompt must fit in
    `longest_prompt` tokens and every limit in `longest_response`. The features and soft
    labels are as `generate_batch` documents."""
    static = static_decoder.supports(model) if static is None else static
    dev = model.get_input_embeddings().weight.device
    stop = torch.tensor(stop_ids, dtype=torch.long, device=dev)
    feat_dim = len(layer_ids) * model.config.get_text_config().hidden_size
    queue = (_checked(r, longest_prompt, longest_response) for r in requests)
    steps = rows = None
    more = True  # the queue may hold more requests
    while True:
        if rows is None or (not steps.refills and not bool(rows.live.any())):  # a new batch
            new = list(islice(queue, batch))
            if not new:
                return
            more = len(new) == batch
            steps = (_StaticSteps if static else _HFSteps)(model, layer_ids, len(new), longest_prompt,
                                                           longest_response, pad_id)
            rows = _Rows(len(new), longest_prompt, longest_response, feat_dim, topk, stop)
            yield from _admit(steps, rows, list(range(len(new))), new, temperature, generator)
        elif steps.refills and more and not bool(rows.live.all()):  # refill the free rows
            free = (~rows.live).nonzero()[:, 0].tolist()
            new = list(islice(queue, len(free)))
            more = len(new) == len(free)
            if new:
                yield from _admit(steps, rows, free[:len(new)], new, temperature, generator)
        if not bool(rows.live.any()):
            if steps.refills and not more:
                return
            continue
        if not (steps.refills and more) and int((~rows.live).sum()) >= steps.compact_at(len(rows.live)):
            # the queue is dry (or the batch cannot refill): drop finished rows from the batch
            keep = rows.live.nonzero()[:, 0]
            steps.select(keep)
            rows.select(keep)
        logits, f = steps(rows.nxt[:, None], rows.pos[:, None])  # (A, V), (A, 1, k*H)
        rows.capture(f)
        live = rows.live.nonzero()[:, 0]  # (R,)
        yield from _ended(steps, rows, rows.take(live, logits[live], temperature, generator))


def _checked(req: Request, longest_prompt: int, longest_response: int) -> Request:
    if not 1 <= len(req.prompt) <= longest_prompt:
        raise ValueError(f"a prompt of {len(req.prompt)} tokens: the stream takes 1 to {longest_prompt}")
    if not 1 <= req.max_new_tokens <= longest_response:
        raise ValueError(f"max_new_tokens {req.max_new_tokens}: the stream takes 1 to {longest_response}")
    return req


def _admit(steps, rows: _Rows, idx: list[int], new: list[Request], temperature, generator):
    logits, feats = steps.admit(idx, [r.prompt for r in new])  # (R, V), R x (n_i, k*H)
    for i, r, f in zip(idx, new, feats):
        rows.begin(i, r, f)
    yield from _ended(steps, rows, rows.take(torch.tensor(idx, device=rows.live.device), logits, temperature,
                                             generator))


def _ended(steps, rows: _Rows, ended: list[int]):
    steps.release(ended)
    for i in ended:
        yield rows.finish(i)


def generate_batch(model, prompts: list[list[int]], layer_ids: list[int], max_new_tokens: int,
                   stop_ids: list[int], pad_id: int, temperature: float = 0.0,
                   generator: torch.Generator | None = None, static: bool | None = None,
                   topk: int = 0) -> list[Generated]:
    """Generate for a batch of tokenized prompts, results in their order. The features of a
    sequence are the hidden states of the tokens the target consumed: all prompt tokens and
    all response tokens but the last (which was only produced). Finished rows leave the batch
    (and its cache). `static`: use the lean static-buffer forward (default: when the model
    supports it). `topk` > 0: also keep the target's top-k distribution over every response
    token (`soft`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    requests = [Request(p, max_new_tokens, i) for i, p in enumerate(prompts)]
    got = {r.key: g for r, g in generate_stream(
        model, requests, layer_ids, stop_ids, pad_id, batch=len(prompts), longest_prompt=max(map(len, prompts)),
        longest_response=max_new_tokens, temperature=temperature, generator=generator, static=static, topk=topk)}
    return [got[i] for i in range(len(prompts))]


class _SoftBuffer:
    """The top-k distributions of a generating batch, by (row, step)."""

    def __init__(self, b: int, n: int, k: int):
        self.ids = torch.zeros(b, n, k, dtype=torch.int32)  # (B, N, k)
        self.logprobs = torch.zeros(b, n, k, dtype=torch.float16)  # (B, N, k)
        self.rest = torch.zeros(b, n, dtype=torch.float16)  # (B, N)

    def put(self, rows: torch.Tensor, steps: torch.Tensor, soft: SoftLabels) -> None:
        """rows, steps: (R,) each, the row and the response step each distribution is for."""
        self.ids[rows, steps], self.logprobs[rows, steps], self.rest[rows, steps] = soft.ids, soft.logprobs, soft.rest

    def select(self, rows: torch.Tensor) -> None:
        self.ids, self.logprobs, self.rest = self.ids[rows], self.logprobs[rows], self.rest[rows]

    def row(self, i: int, n: int) -> SoftLabels:
        return SoftLabels(self.ids[i, :n].clone(), self.logprobs[i, :n].clone(), self.rest[i, :n].clone())


@torch.inference_mode()
def prefill_features(model, sequences: list[list[int]], layer_ids: list[int], static: bool | None = None,
                     prompt_lens: list[int] | None = None, topk: int = 0
                     ) -> tuple[list[torch.Tensor], list[SoftLabels] | None]:
    """The features `generate_batch` would have captured for sequences it wrote (prompt +
    response): one target forward per sequence over every token but the last, without
    padding. Rebuilds a data shard from stored responses at the cost of a prefill. With
    `topk` > 0 (and each sequence's prompt length) also the top-k distributions over the
    response tokens, as `generate_batch(topk=...)` keeps them; else None."""
    dev = model.get_input_embeddings().weight.device
    if static is None:
        static = static_decoder.supports(model)
    if topk > 0 and (prompt_lens is None or len(prompt_lens) != len(sequences)):
        raise ValueError("prefill_features with topk needs one prompt length per sequence")
    feats, softs = [], [] if topk > 0 else None
    for j, seq in enumerate(sequences):
        ids = torch.tensor(seq[:-1], device=dev)[None]  # (1, n): the tokens the target consumed
        pos = torch.arange(ids.shape[1], device=dev)[None]  # (1, n)
        start = prompt_lens[j] - 1 if topk > 0 else ids.shape[1] - 1  # the first position whose logits we keep
        if static:
            kv = static_decoder.KVBuffer(model, 1, ids.shape[1])
            final, f = static_decoder.forward(model, ids, pos, kv, None, layer_ids)  # (1, n, H), (1, n, k*H)
            logits = model.get_output_embeddings()(final[0, start:]) if topk > 0 else None  # (R, V)
        else:
            out = model(input_ids=ids, position_ids=pos, output_hidden_states=True, use_cache=False,
                        logits_to_keep=ids.shape[1] - start)
            f = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)  # (1, n, k*H)
            logits = out.logits[0]  # (R, V)
        feats.append(fp16_features(f[0]).cpu())
        if topk > 0:
            softs.append(SoftLabels.from_logits(logits, topk))
    return feats, softs
