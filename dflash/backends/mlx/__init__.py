"""The MLX backend: an MLX port of the target adapter, the draft and the speculative loop. Its
modules import mlx, never torch; checks, statistics and error types come from the engine's
torch-free modules. The public entry is `dflash.model_mlx`."""
