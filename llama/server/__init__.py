"""llama-server: an OpenAI-compatible HTTP server that batches requests continuously over one shared, prefix-reusing KV cache."""
