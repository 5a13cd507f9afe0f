"""`dflash train`: regenerating responses with the target (and rebuilding kept ones by prefill),
the block-diffusion training loop with resume and DDP, held-out evaluation, plots and shipping.
May import dflash.text and dflash.engine."""
