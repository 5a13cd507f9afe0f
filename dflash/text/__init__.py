"""Text around the engine: the pipeline (target + draft + tokenizer, chat template, stop ids,
mask token), the default target's assets, offline prompt sets, the draft vocabulary counts,
the incremental detokenizer with stop strings, and the text session shared by `dflash chat`
and the server. May import dflash.engine only."""
