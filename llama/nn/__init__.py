"""The model's building blocks beside llama/model.py: a session that keeps a KV cache with its tokens,
the row-exact attention, the tensor-parallel transform, and how Meta's shards split the weights."""
