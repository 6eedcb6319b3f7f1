"""Chat: Meta's dialog format and a conversation that keeps its KV cache between turns."""
