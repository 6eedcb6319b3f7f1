"""Where the process runs: devices and memory, torchrun ranks, $LLAMA_HOME, progress reports, files and memory pages."""
