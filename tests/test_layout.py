"""The package layering is a contract, checked on every test run (pyproject.toml's
[tool.importlinter]): cli on top, the engine at the bottom, no import cycles, the backends
independent, and `import dflash` loading no torch."""

import subprocess
import sys
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml")) == 0


def test_import_dflash_and_the_cli_parser_load_no_heavy_library():
    code = ("import sys, dflash, dflash.engine.errors, dflash.engine.config\n"
            "from dflash.cli.commands import build_parser\n"
            "build_parser()\n"
            "heavy = [m for m in ('torch', 'uvicorn', 'fastapi', 'transformers', 'mlx') if m in sys.modules]\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


def test_public_names_are_importable_from_the_top_package():
    import dflash
    from dflash.generate import stream_generate
    from dflash.model import DFlashDraftModel, dflash_generate

    assert dflash.DFlashDraftModel is DFlashDraftModel and dflash.dflash_generate is dflash_generate
    assert dflash.stream_generate is stream_generate
