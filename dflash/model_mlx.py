"""The seed's MLX entry point (Apple silicon): `from dflash.model_mlx import load, load_draft,
stream_generate, generate`. The backend lives in `dflash.backends.mlx`."""

from dflash.backends.mlx.loop import *  # noqa: F401,F403
from dflash.backends.mlx.loop import __all__  # noqa: F401
