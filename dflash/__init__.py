"""dflash: lossless block-diffusion speculative decoding (DFlash) for Hugging Face LLMs."""

__version__ = "0.1.0"
