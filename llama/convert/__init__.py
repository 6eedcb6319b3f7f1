"""Other formats into Meta's checkpoint layout (GGUF files, Hugging Face folders, quantized checkpoints), and the
default model's download."""
