"""Target + draft + tokenizer, loaded together, and how the loop speculates with them
(`SpecSettings`): what the CLI, the chat, the benchmark and the server share. `Pipeline.stream`
is the one place a text-level caller starts the speculative loop."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from dflash.engine.config import DFlashConfig
from dflash.engine.draft import DFlashDraftModel
from dflash.engine.loop import Row, Step, open_row, run_row
from dflash.engine.policy import AdaptivePolicy
from dflash.engine.prompt_cache import PromptCache
from dflash.engine.proposers import PROPOSERS, DraftHead, TreeState, build_proposer
from dflash.engine.request import SamplingParams
from dflash.engine.suffix import GlobalSuffixIndex
from dflash.engine.target import TargetModel, check_compatible

if TYPE_CHECKING:
    from dflash.engine.costmodel import BatchCost

SHIPPED_DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-instruct"
POLICIES = ("fixed", "adaptive")


@dataclass(frozen=True)
class SpecSettings:
    """How the loop speculates. `proposer`: "hybrid" (the draft's top-k and n-gram matches of
    the text in one tree), "draft" (the DFlash draft's chain), "tree" (a tree over its top-k),
    "suffix" (n-gram matches alone); trees are sized per step by this machine's cost model,
    which also skips the draft pass while it does not pay. `policy` cuts the draft's chain:
    "adaptive" chooses each step's verify length, plain steps included, by the cost model;
    "fixed" verifies the whole block, or the proposals the draft gives at least
    `draft_threshold`. Defaults (None): "hybrid", measured fastest on every prompt set here;
    with a `draft_threshold`, the draft's chain under the fixed policy that applies it.
    `shared_suffix`: also match earlier responses of this pipeline (the server's; bounded)."""
    block_size: int | None = None  # None: the draft's
    draft_threshold: float = 0.0
    proposer: str | None = None  # None: "hybrid", or "draft" with a draft_threshold
    policy: str | None = None  # None: "adaptive", or "fixed" with a draft_threshold
    shared_suffix: bool = False

    def __post_init__(self):
        if self.block_size is not None and (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                                            or self.block_size < 1):
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.draft_threshold, (int, float)) or not 0.0 <= self.draft_threshold <= 1.0:
            raise ValueError(f"draft_threshold must be a probability in [0, 1], got {self.draft_threshold!r}")
        if self.proposer is None:
            object.__setattr__(self, "proposer", "draft" if self.draft_threshold > 0 else "hybrid")
        if self.proposer not in PROPOSERS:
            raise ValueError(f"unknown proposer {self.proposer!r}: use one of {', '.join(PROPOSERS)}")
        if self.policy is None:
            object.__setattr__(self, "policy", "fixed" if self.draft_threshold > 0 else "adaptive")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown verify policy {self.policy!r}: use one of {', '.join(POLICIES)}")

    @property
    def adaptive_chain(self) -> bool:
        """The draft's chain cut by the adaptive policy (trees size themselves)."""
        return self.proposer == "draft" and self.policy == "adaptive"

    @property
    def needs_cost_model(self) -> bool:
        return self.adaptive_chain or self.proposer != "draft"


@dataclass
class Pipeline:
    target: TargetModel
    draft: DFlashDraftModel | None
    tokenizer: object
    draft_trained: bool  # False: a random draft (tau ~1, a demonstration of the loop only)
    draft_path: str | None = None
    spec: SpecSettings = field(default_factory=SpecSettings)
    prompts: PromptCache = field(default_factory=PromptCache)  # recent prompts' K/V (engine/prompt_cache.py);
    # the with_* pipelines share it (its entries are per target adapter)
    _cost_model: object = field(default=None, repr=False)
    _shared: GlobalSuffixIndex | None = field(default=None, repr=False)
    _tree_states: dict[tuple[str, bool], TreeState] = field(default_factory=dict, repr=False)
    _draft_layout: object = field(default=None, repr=False)

    def block_size(self, spec: SpecSettings | None = None) -> int:
        spec = spec or self.spec
        return spec.block_size or (self.draft.config.block_size if self.draft is not None else 1)

    def cost_model(self):
        """This machine's cost model for this target and draft: measured once (a few seconds),
        then read from the cache (engine/costmodel.py)."""
        if self._cost_model is None:
            from dflash.engine.costmodel import load_or_measure

            self._cost_model = load_or_measure(self.target, self.draft)
        return self._cost_model

    def stream(self, input_ids: torch.Tensor, max_new_tokens: int, params: SamplingParams = SamplingParams(),
               generator: torch.Generator | None = None, spec: SpecSettings | None = None,
               stop_token_ids=None) -> Iterator[Step]:
        """The speculative loop on this pipeline (engine.loop.stream_generate) with `spec`
        (default: the pipeline's own settings), stopping at `stop_token_ids` (default: the
        tokenizer's stop tokens)."""
        return run_row(self.open_row(input_ids, max_new_tokens, params, generator, spec, stop_token_ids), input_ids)

    def open_row(self, input_ids: torch.Tensor, max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 generator: torch.Generator | None = None, spec: SpecSettings | None = None, stop_token_ids=None,
                 batch: BatchCost | None = None) -> Row:
        """A request as a `Row` of the loop (engine/step.py), its proposer and policy built from
        `spec` (default: the pipeline's settings). `batch`: the cost model shared by the rows of
        a batch (`batch_cost()`); the row's tree then learns in a copy of the pipeline's tree state,
        handed back by `close_row`, since rows of a batch interleave their steps."""
        spec = spec or self.spec
        block = self.block_size(spec)
        cost = self.cost_model() if spec.needs_cost_model and block > 1 else None
        policy = AdaptivePolicy(cost, block) if spec.adaptive_chain and block > 1 else None
        proposer = None
        if block > 1:
            state = self.tree_state(spec.proposer, params)
            proposer = build_proposer(spec.proposer, self.draft, self.target, params,
                                      self.draft.config.mask_token_id if self.draft is not None else None,
                                      generator, cost_model=batch if batch is not None and cost is not None else cost,
                                      block_size=block,
                                      global_index=self.shared_index() if spec.shared_suffix else None,
                                      state=copy.deepcopy(state) if batch is not None else state,
                                      layout=self.draft_layout())
        stops = self.stop_token_ids if stop_token_ids is None else stop_token_ids
        return open_row(self.draft, self.target, input_ids, max_new_tokens, stop_token_ids=stops, params=params,
                        block_size=block, generator=generator, draft_threshold=spec.draft_threshold, proposer=proposer,
                        policy=policy, cost_model=cost, prompt_cache=self.prompts)

    def close_row(self, row: Row, spec: SpecSettings | None = None) -> None:
        """A finished row of a batch: what its tree learned becomes the pipeline's tree state."""
        state = getattr(row.proposer, "state", None)
        if isinstance(state, TreeState):
            self._tree_states[((spec or self.spec).proposer, row.params.greedy)] = state

    def default_max_batch(self) -> int:
        """The largest batch a server runs by default on this machine (`costmodel.batch_limit`);
        1 where the target's passes cannot be shared (nothing to measure)."""
        from dflash.engine import static_decoder
        from dflash.engine.costmodel import batch_limit

        if not static_decoder.supports_rows(self.target.linears):
            return 1
        return batch_limit(self.cost_model())

    def batch_cost(self) -> BatchCost | None:
        """A cost model for the rows of one batch (engine/costmodel.py, `BatchCost`); None when
        the settings size nothing by cost."""
        if not (self.spec.needs_cost_model and self.block_size() > 1):
            return None
        from dflash.engine.costmodel import BatchCost

        return BatchCost(self.cost_model())

    def draft_layout(self):
        """The draft's linears in the target's layout (`TargetModel.draft_layout`), built once
        for this pipeline's draft and target (None: the draft's own modules run)."""
        if self._draft_layout is None and self.draft is not None:
            self._draft_layout = self.target.draft_layout(self.draft) or False
        return self._draft_layout or None

    def tree_state(self, kind: str, params: SamplingParams) -> TreeState:
        """What this pipeline's `kind` trees learned in earlier requests (greedy and sampled
        requests apart: they accept differently), handed to the next request's proposer."""
        return self._tree_states.setdefault((kind, params.greedy), TreeState())

    def shared_index(self) -> GlobalSuffixIndex:
        """Earlier responses of this pipeline, for the n-gram source (bounded in memory)."""
        if self._shared is None:
            self._shared = GlobalSuffixIndex()
        return self._shared

    def remember(self, response_ids: list[int]) -> None:
        """Add a finished response to the shared index (when the settings use one)."""
        if self.spec.shared_suffix and response_ids:
            self.shared_index().add(response_ids)

    @classmethod
    def load(cls, target: str | None = None, draft: str | None = None, random_draft_layers: int = 1,
             seed: int = 0, quiet: bool = False, kernels: str = "auto",
             spec: SpecSettings | None = None, precision: str = "auto") -> "Pipeline":
        """`target`: None for the default SmolLM2-135M-Instruct, or an HF folder. `draft`: a
        checkpoint folder, None for the shipped draft of the default target, or "random".
        `spec`: how the loop speculates (default `SpecSettings()`). `precision`: the numbers the
        target computes (engine/precision.py; "auto": the default target's own GGUF blocks, 4-bit)."""
        from dflash.text.assets import load_target, source_gguf

        model, tokenizer = load_target(target)
        tgt = TargetModel(model, kernels=kernels, precision=precision,  # "auto": measured kernels (engine/kernels.py)
                          gguf=source_gguf(target) if precision in ("auto", "int4", "int8") else None)
        if draft is None and target is None and (SHIPPED_DRAFT / "model.safetensors").exists():
            draft = str(SHIPPED_DRAFT)
        if draft is None or draft == "random":
            torch.manual_seed(seed)
            cfg = DFlashConfig.for_target(model.config, num_hidden_layers=random_draft_layers,
                                          mask_token_id=_mask_token(tokenizer, tgt))
            if not quiet:
                print("note: no trained draft for this target, using an UNTRAINED random draft: "
                      "output is still exact, but expect tau ~1 and no speedup", file=sys.stderr)
            return cls(tgt, DFlashDraftModel(cfg).eval(), tokenizer, False, None, spec or SpecSettings()).warm()
        return cls(tgt, None, tokenizer, False, None, spec or SpecSettings()).with_draft(draft)

    def with_draft(self, path: str) -> "Pipeline":
        """This target and tokenizer with the draft checkpoint at `path` (checked against the
        target), with its own cost model and tree states: one side of a comparison of drafts
        on the same loaded target (`dflash bench --compare-draft`)."""
        d = DFlashDraftModel.from_pretrained(path)
        check_compatible(d.config, self.target)
        return Pipeline(self.target, d, self.tokenizer, True, str(path), self.spec, self.prompts).warm()

    def with_tree_state(self, kind: str, state: TreeState, greedy: bool = True) -> "Pipeline":
        """This pipeline's models, tokenizer and cost model, whose `kind` trees (of greedy or
        sampled requests) start from `state`: one side of an A/B of what trees carry from
        request to request (benchmarks/tree_state_ab.py)."""
        return Pipeline(self.target, self.draft, self.tokenizer, self.draft_trained, self.draft_path, self.spec,
                        self.prompts, _cost_model=self._cost_model, _tree_states={(kind, greedy): state})

    def with_cost_model(self, cost_model) -> "Pipeline":
        """This pipeline (models, tokenizer, tree states) sizing its trees and chains by
        `cost_model` instead of the machine's measured one (a benchmark's or a test's)."""
        return replace(self, _cost_model=cost_model)

    def with_prompt_cache(self, capacity_mb: float) -> "Pipeline":
        """This pipeline keeping recent prompts' K/V in a cache of its own of `capacity_mb` MiB
        (0: none, every prompt computed in full)."""
        return replace(self, prompts=PromptCache(capacity_mb))

    def with_precision(self, precision: str) -> "Pipeline":
        """This model, tokenizer and draft on a new target adapter at `precision`
        (engine/precision.py), with its own cost model and tree states: one side of a comparison
        of precisions on the same loaded model (`dflash bench --compare-precision`)."""
        target = TargetModel(self.target.model, kernels=self.target.kernels, precision=precision, gguf=self.target.gguf)
        return Pipeline(target, self.draft, self.tokenizer, self.draft_trained, self.draft_path, self.spec,
                        self.prompts).warm()

    def with_kernels(self, kernels: str) -> "Pipeline":
        """This model, tokenizer and draft on a new target adapter with the kernel setting
        `kernels` (engine/target.py), with its own cost model and tree states: one side of a
        comparison of kernel settings on the same loaded model (`dflash bench --compare-kernels`)."""
        target = TargetModel(self.target.model, kernels=kernels, precision=self.target.precision, gguf=self.target.gguf)
        return Pipeline(target, self.draft, self.tokenizer, self.draft_trained, self.draft_path, self.spec,
                        self.prompts).warm()

    def warm(self) -> "Pipeline":
        """Measure (or read from the cache) this machine's cost model and build the draft's
        layout now, as the kernels are measured at load: a first request must not pay for them
        (the first `make demo` on a new machine timed a 2 s measurement as time to first token)."""
        if self.spec.needs_cost_model and self.block_size() > 1:
            self.cost_model()
        self.draft_layout()
        if self.draft is not None:  # the draft vocabulary's lm_head rows (0.14 s for the default draft)
            DraftHead.build(self.draft, self.target)
        return self

    @property
    def stop_token_ids(self) -> list[int]:
        return stop_token_ids(self.tokenizer)

    def encode_chat(self, messages: list[dict]) -> torch.Tensor:
        """Chat messages as the target reads them (`prompts.chat_ids`: its chat template, or plain text) -> (1, T)."""
        if not messages:
            raise ValueError("the message list is empty")
        from dflash.text.prompts import chat_ids

        return torch.tensor([chat_ids(self.tokenizer, messages)], device=self.target.device)

    def encode_text(self, text: str, special: bool = True) -> torch.Tensor:
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=special).input_ids
        return ids.to(self.target.device)


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>")


def stop_token_ids(tokenizer, names: tuple[str, ...] = END_OF_TURN) -> list[int]:
    """The eos id plus the end-of-turn tokens of the common chat templates the tokenizer knows
    (`names`: which end-of-turn tokens count; the training data keeps eos + `<|im_end|>`)."""
    ids = {tokenizer.eos_token_id}
    for tok in names:
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


def _mask_token(tokenizer, target: TargetModel) -> int:
    """A vocabulary id for the mask slots: a reserved/unused-looking token if there is one."""
    for tok in ("<|MASK|>", "<mask>", "<|fim_pad|>", "<pad>"):
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i != tokenizer.unk_token_id and 0 <= i < target.info.vocab_size:
            return i
    return target.info.vocab_size - 1
