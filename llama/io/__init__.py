"""Weights on disk and into memory: checkpoints, their shards and tensor files, loading, model identity, prompt caches."""
