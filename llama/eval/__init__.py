"""Measuring a model: decoding speed and memory, and perplexity over a text."""
