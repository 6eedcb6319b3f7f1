"""The model's building blocks beside llama/model.py: the KV caches, a session that keeps one with its tokens,
the row-exact attention, and the tensor-parallel transform."""
