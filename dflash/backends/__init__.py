"""Other runtimes for the same drafts: `mlx` (Apple's MLX, the loop on the engine's shared
checks, statistics and sampling rules) and `vllm` (checkpoint export, the vLLM worker process
and its environment). Each may import dflash.text and dflash.engine, never each other."""
