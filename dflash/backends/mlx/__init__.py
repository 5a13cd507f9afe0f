"""The MLX backend: an MLX port of the target adapter (target.py), the draft (draft.py), the
sampling arithmetic (sampling.py) and the speculative loop (loop.py, the torch engine's loop
step for step); api.py is the public entry (`dflash.model_mlx`). Its modules import mlx, never
torch; the argument checks, sampling parameters, verify policies, statistics and error types
are the engine's torch-free modules (request, params, policy, stats, errors, config)."""
