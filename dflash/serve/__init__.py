"""`dflash serve`: the OpenAI-compatible HTTP API, request validation, the single model worker
with its bounded queue, Prometheus metrics. May import dflash.text and dflash.engine."""
