"""llama.cpp as a peer and as a runtime for our drafts: `build` (llama-server from the pinned
source package, once per machine), `export` (a draft as a llama.cpp `dflash` GGUF) and
`server` (llama-server on loopback, asked for completions over its HTTP API)."""
