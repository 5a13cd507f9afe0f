"""vLLM: `export` writes a draft in the folder layout vLLM and SGLang read; `worker` runs vLLM
in its own interpreter (it pins other library versions) and speaks JSON lines to it, for the
benchmark. May import dflash.text and dflash.engine."""
