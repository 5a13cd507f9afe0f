"""The engine's error types, importable without torch (the MLX backend raises the same ones).
Each names the problem in its message; the CLI prints it without a traceback."""


class ConfigError(ValueError):
    """A draft config.json is missing a key or holds a value that cannot work."""


class CheckpointError(RuntimeError):
    """A draft checkpoint folder is missing, incomplete or corrupt."""


class IncompatibleDraftError(ValueError):
    """The draft was not built for this target."""


class GenerationError(ValueError):
    """Bad arguments to a generation call."""
