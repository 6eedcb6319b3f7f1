"""The compiled decode step: torch.compile, and packages compiled ahead of time and stored on disk."""
