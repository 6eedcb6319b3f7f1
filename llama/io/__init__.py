"""Weights on disk and into memory: checkpoints and tensor files, loading, model identity, prompt caches, KV block
files."""
