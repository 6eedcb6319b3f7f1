"""llama-convert: turn a GGUF file or a Hugging Face LLaMA directory into Meta's checkpoint layout, or
quantize a checkpoint."""

import sys
from pathlib import Path
from typing import Optional

from llama.cli.common import run
from llama.cli.printer import ProgressPrinter
from llama.errors import LlamaError


def main(src: str, dest: str, quantize: Optional[str] = None, dequantize: bool = False, overwrite: bool = False) -> None:
    """Convert SRC into a checkpoint directory DEST (params.json, consolidated.00.pth, tokenizer files).

    SRC is a .gguf file of llama architecture, a Hugging Face LLaMA directory (config.json, *.safetensors
    or pytorch_model*.bin, tokenizer.model or tokenizer.json), or, with --quantize, a float checkpoint
    directory in Meta's layout. A GGUF's Q8_0, Q4_0 and Q4_1 weights stay quantized without any loss;
    Q6_K, Q4_K and Q5_K become the nearest of int8 / int4 (a line says so for each type); other types and
    the embedding become float32. DEST records its quantization in quantization.json, so loading it needs
    no flag. DEST must not exist or be empty unless --overwrite; it appears only once complete.

    Args:
        src: the GGUF file, Hugging Face directory or checkpoint directory.
        dest: the checkpoint directory to create.
        quantize: int8 (one scale per output channel) or int4 (scale and minimum per 32 columns): quantize
            every linear layer's weight, one tensor at a time.
        dequantize: write a GGUF's quantized weights as float32 instead of keeping them quantized.
        overwrite: replace DEST if it exists.
    """
    from llama.convert.gguf import convert_gguf
    from llama.convert.hf import convert_hf
    from llama.convert.quantize_checkpoint import check_method, convert_meta

    quantize = check_method(None if quantize is None else str(quantize))
    src_path, dest_path = Path(str(src)).expanduser(), Path(str(dest)).expanduser()
    progress = ProgressPrinter(prefix="llama-convert: ")
    notice = lambda line: print(f"llama-convert: {line}", file=sys.stderr, flush=True)  # noqa: E731
    if src_path.is_dir() and (src_path / "params.json").is_file():
        if quantize is None:
            raise LlamaError(f"{src_path} is already a checkpoint in Meta's layout; pass --quantize int8 or int4 to quantize it")
        convert = lambda s, d: convert_meta(s, d, quantize, overwrite=overwrite, progress=progress)  # noqa: E731
    elif src_path.is_dir():
        convert = lambda s, d: convert_hf(s, d, overwrite=overwrite, quantize=quantize, progress=progress)  # noqa: E731
    elif src_path.is_file():
        convert = lambda s, d: convert_gguf(s, d, overwrite=overwrite, dequantize=bool(dequantize),  # noqa: E731
                                            quantize=quantize, notice=notice, progress=progress)
    else:
        raise LlamaError(f"{src_path} does not exist; give a .gguf file or a Hugging Face model directory")
    if dequantize and not src_path.is_file():
        raise LlamaError("--dequantize applies to a GGUF file's quantized weights only")
    print(f"converting {src_path} ...", file=sys.stderr, flush=True)
    print(convert(src_path, dest_path))


def cli() -> None:
    run(main, "llama-convert")


if __name__ == "__main__":
    cli()
