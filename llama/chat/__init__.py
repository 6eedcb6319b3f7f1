"""Chat: a conversation that keeps its KV cache between turns."""
