"""llama-convert: turn a GGUF file or a Hugging Face LLaMA directory into Meta's checkpoint layout."""

import sys
from pathlib import Path

from llama.cli.common import run
from llama.errors import LlamaError


def main(src: str, dest: str, overwrite: bool = False) -> None:
    """Convert SRC into a checkpoint directory DEST (params.json, consolidated.00.pth, tokenizer files).

    SRC is a .gguf file of llama architecture (float or quantized; quantized weights become float32), or
    a Hugging Face LLaMA directory (config.json, *.safetensors or pytorch_model*.bin, tokenizer.model or
    tokenizer.json). DEST must not exist or be empty unless --overwrite; it appears only once complete.

    Args:
        src: the GGUF file or Hugging Face directory.
        dest: the checkpoint directory to create.
        overwrite: replace DEST if it exists.
    """
    from llama.convert.gguf import convert_gguf
    from llama.convert.hf import convert_hf

    src_path, dest_path = Path(str(src)).expanduser(), Path(str(dest)).expanduser()
    if src_path.is_dir():
        convert = convert_hf
    elif src_path.is_file():
        convert = convert_gguf
    else:
        raise LlamaError(f"{src_path} does not exist; give a .gguf file or a Hugging Face model directory")
    print(f"converting {src_path} ...", file=sys.stderr, flush=True)
    print(convert(src_path, dest_path, overwrite=overwrite))


def cli() -> None:
    run(main, "llama-convert")


if __name__ == "__main__":
    cli()
