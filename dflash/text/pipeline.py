"""Target + draft + tokenizer, loaded together: what the CLI, the benchmark and the server share."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.engine.config import DFlashConfig
from dflash.engine.draft import DFlashDraftModel
from dflash.engine.target import TargetModel, check_compatible

SHIPPED_DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-instruct"


@dataclass
class Pipeline:
    target: TargetModel
    draft: DFlashDraftModel | None
    tokenizer: object
    draft_trained: bool  # False: a random draft (tau ~1, a demonstration of the loop only)
    draft_path: str | None = None

    @classmethod
    def load(cls, target: str | None = None, draft: str | None = None, random_draft_layers: int = 1,
             seed: int = 0, quiet: bool = False) -> "Pipeline":
        """`target`: None for the default SmolLM2-135M-Instruct, or an HF folder. `draft`: a
        checkpoint folder, None for the shipped draft of the default target, or "random"."""
        from dflash.text.assets import load_target

        model, tokenizer = load_target(target)
        tgt = TargetModel(model)
        if draft is None and target is None and (SHIPPED_DRAFT / "model.safetensors").exists():
            draft = str(SHIPPED_DRAFT)
        if draft is None or draft == "random":
            torch.manual_seed(seed)
            cfg = DFlashConfig.for_target(model.config, num_hidden_layers=random_draft_layers,
                                          mask_token_id=_mask_token(tokenizer, tgt))
            if not quiet:
                print("note: no trained draft for this target, using an UNTRAINED random draft: "
                      "output is still exact, but expect tau ~1 and no speedup", file=sys.stderr)
            return cls(tgt, DFlashDraftModel(cfg).eval(), tokenizer, False, None)
        d = DFlashDraftModel.from_pretrained(draft)
        check_compatible(d.config, tgt)
        return cls(tgt, d, tokenizer, True, str(draft))

    @property
    def stop_token_ids(self) -> list[int]:
        return stop_token_ids(self.tokenizer)

    def encode_chat(self, messages: list[dict]) -> torch.Tensor:
        """Chat messages through the target's chat template -> (1, T)."""
        if not messages:
            raise ValueError("the message list is empty")
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.encode_text(text, special=False)
        return self.encode_text("\n".join(m["content"] for m in messages))

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
