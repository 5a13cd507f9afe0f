"""The engine: everything one speculative generation needs and nothing about text or serving.

Owns the typed draft config, the draft network and its checkpoint format, the target adapter
(its own weight layout and static decoder), the KV caches with `trim(n)`, the sampling rules,
the speculative loop and the one fold of loop steps into statistics. It imports torch and
transformers only: nothing from dflash.text, serve, bench, train, cli or backends (checked by
import-linter, see pyproject.toml). `errors`, `config`, `checks` and `stats` import no torch, so
the MLX backend can share them."""
