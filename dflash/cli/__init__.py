"""The `dflash` command: one parser registry and one error handler (`main`), and one module per
subcommand that builds its parser and imports its heavy dependencies only when it runs. The top
layer: may import every other package."""

from dflash.cli.commands import main

__all__ = ["main"]
