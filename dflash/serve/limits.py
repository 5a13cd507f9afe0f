"""What one request may ask of the server: the `--max-*` and `--request-timeout` options of
`dflash serve`. Importable without torch or the web stack (the CLI parser takes its defaults)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PROMPT_CHARS_PER_TOKEN = 32  # the default prompt-character limit: this many characters per context token


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (the `--max-*` and `--request-timeout` options)."""
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN x the context
    max_tokens_default: int = 512  # chat requests without max_tokens; completions: min(16, this)
    max_tokens_limit: int = 4096  # a larger max_tokens is lowered to this (finish_reason "length")
    request_timeout: float | None = None  # seconds of generation, then finish_reason "length"

    def resolved(self, context: int) -> Limits:
        """Check the limits (ValueError naming the option) and fill in the context-derived default."""
        for name in ("max_body_bytes", "max_prompt_chars", "max_tokens_default", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout!r}")
        return dataclasses.replace(self, max_prompt_chars=self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * context)
