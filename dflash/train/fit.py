"""`dflash train fit`: block-diffusion training of a DFlash draft on cached target features.

The batch of step s is a pure function of (seed, s): epoch e = s // steps_per_epoch shuffles
the training sequences with seed (seed, e) and re-samples each sequence's anchors with seed
(seed, e, sequence). So a resumed run sees exactly the data an uninterrupted one would."""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.engine.config import DFlashConfig
from dflash.engine.draft import DFlashDraftModel
from dflash.engine.io import atomic_folder, atomic_write_text
from dflash.engine.target import TargetModel
from dflash.text.pipeline import stop_token_ids
from dflash.text.vocab import most_frequent
from dflash.train.blocks import (
    VocabSubset,
    build_batch,
    chunked_loss_backward,
    cosine_lambda,
    draft_hidden,
    sample_anchors,
)
from dflash.train.config import FitConfig
from dflash.train.data import Sequence
from dflash.train.generator import FP16_MAX


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _is_heldout(seq_id: str, frac: float) -> bool:
    return (zlib.crc32(seq_id.encode()) % 10_000) < frac * 10_000


class Trainer:
    """Owns the draft, optimizer and schedule; `train_step()` runs one optimizer step."""

    def __init__(self, cfg: FitConfig, hf_model, seqs: list[Sequence], mask_token_id: int,
                 layer_ids: list[int], tokenizer=None, log=print):
        cfg.check()
        self.cfg, self.log, self.tokenizer = cfg, log, tokenizer
        self.rank, self.world = _rank_world()
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        for p in hf_model.parameters():
            p.requires_grad_(False)  # the target, its embedding and lm_head are frozen
        self.target = TargetModel(hf_model.to(self.device))
        self.train_seqs = [s for s in seqs if not _is_heldout(s.id, cfg.heldout_frac)]
        self.heldout = [s for s in seqs if _is_heldout(s.id, cfg.heldout_frac)]
        if not self.train_seqs:
            raise ValueError("no training sequences (all held out or none loaded)")
        hard = [s.id for s in self.train_seqs if s.soft is None]
        if cfg.distill_weight and hard:
            raise ValueError(f"--distill-weight {cfg.distill_weight} needs soft labels, which {len(hard)} training "
                             f"sequences lack (e.g. {hard[0]}): rebuild their shards with --topk")
        dcfg = DFlashConfig.for_target(hf_model.config, num_hidden_layers=cfg.num_layers, mask_token_id=mask_token_id,
                                       block_size=cfg.block_size, target_layer_ids=list(layer_ids),
                                       intermediate_size=cfg.intermediate_size)
        start = DFlashDraftModel.from_pretrained(cfg.init_from) if cfg.init_from else None
        if cfg.draft_vocab:
            dcfg.draft_vocab = frequent_labels([s.labels[s.prompt_len + 1:] for s in self.train_seqs], cfg.draft_vocab,
                                               always=stop_token_ids(tokenizer) if tokenizer is not None else ())
            if start is not None and start.config.draft_vocab:
                # a warm start keeps every id its start could propose: new data alone would drop the
                # ids only the earlier data used (h15 on l + m alone would have dropped 2 815 of its start's
                # 8 192 ids; chat coverage 95% -> 89%)
                dcfg.draft_vocab = sorted(set(dcfg.draft_vocab) | set(start.config.draft_vocab))
        torch.manual_seed(cfg.seed)
        self.draft = DFlashDraftModel(dcfg)
        if cfg.init == "target":
            from dflash.train.init import init_from_target
            init_from_target(self.draft, hf_model)
        if start is not None:
            from dflash.train.init import init_from_draft
            grown = init_from_draft(self.draft, start, cfg.init_from)
            if grown:
                log(f"fit: {cfg.init_from} deepened by {', '.join(grown)} (identity at the start)")
        self.subset = None
        if cfg.loss_vocab in ("data", "sampled"):
            self.label_vocab = torch.cat([s.labels[s.prompt_len + 1:] for s in self.train_seqs]).unique()
            self.subset = VocabSubset(self.label_vocab, self.target.info.vocab_size)
        elif cfg.loss_vocab == "draft":
            self.subset = VocabSubset(torch.tensor(dcfg.draft_vocab), self.target.info.vocab_size, drop_missing=True)
        self.draft.to(self.device).train()
        self.model = self.draft
        if self.world > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(self.draft)
        decay = [p for n, p in self.draft.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.draft.named_parameters() if p.ndim < 2]
        self.opt = _optimizer(cfg, [{"params": decay, "weight_decay": cfg.weight_decay},
                                    {"params": no_decay, "weight_decay": 0.0}])
        self.global_batch = self.world * cfg.batch_size * cfg.grad_accum
        self.steps_per_epoch = max(1, len(self.train_seqs) // self.global_batch)
        self.total_steps = cfg.max_steps or max(1, int(cfg.epochs * self.steps_per_epoch))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, cosine_lambda(self.total_steps, cfg.warmup_frac))
        self.step = 0
        self.stats = {"tokens": 0, "label_positions": 0, "cpu_s": 0.0, "wall_s": 0.0}

    # ---- data order -------------------------------------------------------------------
    def _anchors(self, epoch: int, index: int, seq: Sequence) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch * 100_003 + index)
        return sample_anchors(seq.prompt_len, min(len(seq.tokens), self.cfg.max_seq_len), self.cfg.anchors_per_seq, g)

    def step_indices(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of sequence indices for `step`."""
        epoch, k = divmod(step, self.steps_per_epoch)
        perm = torch.randperm(len(self.train_seqs), generator=torch.Generator().manual_seed(self.cfg.seed * 7919 + epoch))
        ids = perm[k * self.global_batch:(k + 1) * self.global_batch].tolist()
        bs = self.cfg.batch_size
        return [ids[(m * self.world + self.rank) * bs:(m * self.world + self.rank + 1) * bs]
                for m in range(self.cfg.grad_accum)]

    def make_batch(self, indices: list[int], epoch: int, seqs: list[Sequence] | None = None):
        seqs = seqs if seqs is not None else self.train_seqs
        soft = self.cfg.distill_weight > 0 and all(seqs[i].soft is not None for i in indices)
        items = []
        for i in indices:
            s = seqs[i]
            n = min(len(s.tokens), self.cfg.max_seq_len)
            # clamped: shards written before features were clamped hold inf where the target's
            # activations pass fp16's range (Gemma 3's <bos>)
            feats = torch.from_numpy(s.features[: n - 1].astype("float32")).clamp_(-FP16_MAX, FP16_MAX)  # (n-1, kH)
            items.append((s.tokens[:n], feats, self._anchors(epoch, i, s), s.labels[:n],
                          (s.prompt_len, s.soft) if soft else None))
        return build_batch(items, self.cfg.block_size, self.draft.config.mask_token_id, self.cfg.gamma).to(self.device)

    # ---- one optimizer step -----------------------------------------------------------
    def train_step(self) -> dict:
        t0, c0 = time.time(), time.process_time()
        epoch = self.step // self.steps_per_epoch
        batches = [self.make_batch(ix, epoch) for ix in self.step_indices(self.step)]
        wsum = torch.tensor([float(b.weights.sum()) for b in batches]).sum().reshape(1)
        ntok = torch.tensor([float(sum(b.num_tokens for b in batches)), float(sum(int((b.weights > 0).sum()) for b in batches))])
        if self.world > 1:
            dist.all_reduce(wsum)
            dist.all_reduce(ntok)
        scale = self.world / max(float(wsum), 1e-9)  # DDP averages over ranks: this makes it a global mean
        self.opt.zero_grad(set_to_none=True)
        if self.cfg.loss_vocab == "sampled":  # the same rows on every rank: seeded by the step
            g = torch.Generator().manual_seed(self.cfg.seed * 15_485_863 + self.step)
            neg = torch.randperm(self.target.info.vocab_size, generator=g)[: self.cfg.loss_negatives]
            self.subset = VocabSubset(torch.cat([self.label_vocab, neg]), self.target.info.vocab_size)
        loss_sum, correct, count = 0.0, 0, 0
        for m, b in enumerate(batches):
            sync = m == len(batches) - 1 or self.world == 1
            ctx = self.model.no_sync() if (self.world > 1 and not sync) else _null()
            with ctx:
                hidden = draft_hidden(self.model, self.target, b)  # (N, Q, H)
                val, ok = chunked_loss_backward(hidden, self.target, b.labels, b.weights, scale, self.cfg.logits_chunk,
                                                subset=self.subset, soft=b.soft,
                                                distill_weight=self.cfg.distill_weight)
            loss_sum += val
            correct += int(ok.sum())
            count += ok.numel()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        red = torch.tensor([loss_sum, float(correct), float(count), time.process_time() - c0])
        if self.world > 1:
            dist.all_reduce(red)
        self.stats["tokens"] += int(ntok[0])
        self.stats["label_positions"] += int(ntok[1])
        self.stats["cpu_s"] += float(red[3])
        self.stats["wall_s"] += time.time() - t0
        return {"step": self.step, "loss": float(red[0]) / self.world, "acc": float(red[1]) / max(float(red[2]), 1),
                "grad_norm": float(grad_norm), "lr": self.sched.get_last_lr()[0], **self.stats}

    # ---- checkpoints --------------------------------------------------------------------
    def state(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "step": self.step,
                "stats": dict(self.stats), "total_steps": self.total_steps}

    def save(self, out: Path, extra: dict | None = None) -> Path:
        """Atomically write out/ckpt-{step}/ (draft/ in the docs/METHOD.md §4 format, trainer.pt,
        train_config.json) and point out/latest at it. Rank 0 only."""
        out.mkdir(parents=True, exist_ok=True)
        name = f"ckpt-{self.step:07d}"
        final = out / name
        with atomic_folder(final) as tmp:
            self.draft.save_pretrained(tmp / "draft")
            torch.save({**self.state(), **(extra or {})}, tmp / "trainer.pt")
            (tmp / "train_config.json").write_text(json.dumps(asdict(self.cfg), indent=2) + "\n")
        atomic_write_text(out / "latest", name + "\n")
        for old in sorted(out.glob("ckpt-*"))[:-2]:  # keep the last two
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, ckpt: Path) -> dict:
        state = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False)
        loaded = DFlashDraftModel.from_pretrained(ckpt / "draft")
        self.draft.load_state_dict(loaded.state_dict())
        self.draft.train()
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step, self.stats = state["step"], dict(state["stats"])
        return state


def frequent_labels(label_streams: list[torch.Tensor], size: int, always=()) -> list[int]:
    """The `size` most frequent label ids (ties: the smaller id), plus `always`; sorted."""
    return most_frequent(Counter(torch.cat(label_streams).tolist()) if label_streams else Counter(), size, always)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def latest_checkpoint(out: str | Path) -> Path | None:
    p = Path(out) / "latest"
    if not p.exists():
        return None
    ck = Path(out) / p.read_text().strip()
    return ck if (ck / "trainer.pt").exists() else None


# ---- the command --------------------------------------------------------------------------

def _setup_distributed(cfg: FitConfig) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = cfg.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def training_shards(cfg: FitConfig, recorded: dict) -> dict[str, list[int]]:
    """The shards each data folder trains on: as a resumed run recorded them, else its finished
    ones less the first `skip_shards[folder]` (and of `data` only the first `data_shards` left)."""
    from dflash.train.data import DataError, finished_shards

    skip = {os.path.normpath(f): n for f, n in cfg.skip_shards.items()}
    saved = {cfg.data: recorded.get("data_shards"), **recorded.get("more_data_shards", {})}
    shards = {}
    for f in [cfg.data, *cfg.more_data]:
        if saved.get(f) is not None:
            shards[f] = saved[f]
            continue
        done = finished_shards(Path(f))
        left = done[skip.get(os.path.normpath(f), 0):]
        if f == cfg.data and cfg.data_shards:
            left = left[: cfg.data_shards]
        if done and not left:
            raise DataError(f"{f}: skip_shards leaves none of its {len(done)} finished shards to train on")
        shards[f] = left
    return shards


def run_fit(cfg: FitConfig, log=None) -> dict:
    from dflash.text.assets import load_target
    from dflash.text.pipeline import _mask_token
    from dflash.train.data import load_pool
    from dflash.train.evaluate import Evaluator

    cfg.check()
    torch.set_num_threads(cfg.threads)
    _setup_distributed(cfg)
    rank, world = _rank_world()
    out = Path(cfg.out)
    say = log or (lambda s: print(s, flush=True) if rank == 0 else None)
    ckpt = latest_checkpoint(out) if cfg.resume else None
    if ckpt is None and cfg.resume:
        say(f"fit: no checkpoint in {out}; starting fresh")
    folders = [cfg.data, *cfg.more_data]
    recorded = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False) if ckpt is not None else {}
    shards = training_shards(cfg, recorded)
    seqs, layer_ids = load_pool(folders, shards)
    hf, tok = load_target(cfg.target)
    trainer = Trainer(cfg, hf, seqs, _mask_token(tok, TargetModel(hf, kernels="torch")), layer_ids, tok, say)
    if ckpt is not None:
        trainer.load(ckpt)
        say(f"fit: resumed {ckpt} at step {trainer.step}")
    metrics = out / "metrics.jsonl"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(metrics, trainer.step)
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    say(f"fit: {len(trainer.train_seqs)} train / {len(trainer.heldout)} held-out sequences from "
        f"{sum(len(v) for v in shards.values())} shards of {len(folders)} folder(s), "
        f"{sum(p.numel() for p in trainer.draft.parameters()) / 1e6:.2f}M draft params, "
        f"{trainer.steps_per_epoch} steps/epoch, {trainer.total_steps} steps, world {world}")
    evaluator = Evaluator(trainer, tok) if rank == 0 else None
    best = _best_score(out)
    extra = {"data_shards": shards[cfg.data], "more_data_shards": {f: shards[f] for f in cfg.more_data}}
    if rank == 0 and trainer.step == 0 and cfg.init_from:  # a warm start's own score on this held-out split
        best = _score_warm_start(trainer, evaluator, out, metrics, best, say)
    while trainer.step < trainer.total_steps:
        rec = trainer.train_step()
        s = trainer.step
        if rank == 0:
            if s % cfg.log_every == 0 or s == 1:
                say(f"step {s}/{trainer.total_steps} loss {rec['loss']:.4f} acc {rec['acc']:.3f} lr {rec['lr']:.2e} "
                    f"tokens {rec['tokens']} cpu_h {rec['cpu_s'] / 3600:.3f}")
            row = {"kind": "train", **rec}
            if s % cfg.eval_every == 0 or s == trainer.total_steps:
                ev = evaluator.run(tau=cfg.eval_tau_prompts > 0 and (s % cfg.tau_every == 0 or s == trainer.total_steps))
                row.update(ev)
                say(f"eval step {s}: " + " ".join(f"{k} {v:.3f}" for k, v in ev.items() if isinstance(v, float)))
                best = _keep_if_best(trainer, out, {"step": s, **row}, best)
            with open(metrics, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            if s % cfg.ckpt_every == 0 or s == trainer.total_steps:
                trainer.save(out, extra)
        if world > 1:
            dist.barrier()
    if rank == 0:
        trainer.draft.save_pretrained(out / "final")
    return trainer.stats


def _optimizer(cfg: FitConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """AdamW, or RAdam with the same decoupled weight decay (`FitConfig.optimizer`)."""
    if cfg.optimizer == "radam":
        return torch.optim.RAdam(groups, lr=cfg.lr, betas=(0.9, 0.95), decoupled_weight_decay=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def _score_warm_start(trainer: Trainer, evaluator, out: Path, metrics: Path, best: float, say) -> float:
    """Step 0 of a warm start: the starting draft's held-out score, logged and kept as `best`
    so that the run ships the start itself unless training beats it."""
    ev = evaluator.run(tau=False)
    row = {"kind": "eval", "step": 0, "tokens": 0, "label_positions": 0, "cpu_s": 0.0, "wall_s": 0.0, **ev}
    say("eval step 0 (warm start): " + " ".join(f"{k} {v:.3f}" for k, v in ev.items() if isinstance(v, float)))
    with open(metrics, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    return _keep_if_best(trainer, out, row, best)


def _keep_if_best(trainer: Trainer, out: Path, row: dict, best: float) -> float:
    """Save the draft as best/ when this evaluation's held-out block tau (computed at every
    evaluation: one scale for "best") beats `best`; returns the best score."""
    score = row.get("heldout_block_tau", 0.0)
    if score <= best:
        return best
    trainer.draft.save_pretrained(out / "best")
    atomic_write_text(out / "best.json", json.dumps({"score": score, **row}) + "\n")
    return score


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop log rows past the checkpoint we resumed from (they will be re-run)."""
    if not path.exists():
        return
    rows = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= step]
    atomic_write_text(path, "".join(r + "\n" for r in rows))


def _best_score(out: Path) -> float:
    p = out / "best.json"
    return json.loads(p.read_text())["score"] if p.exists() else float("-inf")
