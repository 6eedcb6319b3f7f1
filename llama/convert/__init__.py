"""Other formats into Meta's checkpoint layout: GGUF files, Hugging Face folders, and quantized checkpoints."""
