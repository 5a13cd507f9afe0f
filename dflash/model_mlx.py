"""The seed's MLX entry point (Apple silicon): `from dflash.model_mlx import load, load_draft,
stream_generate, generate`. The backend lives in `dflash.backends.mlx` (its public names in
`dflash.backends.mlx.api`)."""

from dflash.backends.mlx.api import *
from dflash.backends.mlx.api import __all__  # noqa: F401
