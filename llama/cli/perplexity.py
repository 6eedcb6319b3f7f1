"""llama-perplexity: how well a model predicts a text, as llama.cpp's command of the same name measures it."""

import json as jsonlib
from dataclasses import replace
from pathlib import Path

from llama.cli.common import fail, run
from llama.cli.flags import with_model_flags
from llama.cli.flags import model_flags
from llama.cli.loading import build_from_flags, is_main_rank
from llama.cli.printer import ProgressPrinter
from llama.eval.likelihood import check_ctx, perplexity, window_starts


def read_text(path: Path) -> str:
    """The whole of a UTF-8 text file; a missing or non-UTF-8 file is a one-line error."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        fail(f"text file {path} does not exist")
    except IsADirectoryError:
        fail(f"{path} is a directory; give a UTF-8 text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"text file {path} is not UTF-8 text (byte {e.start} is invalid)")
    if not text.strip():
        fail(f"text file {path} is empty")
    return text


@with_model_flags
def main(
    file: str = None,
    ctx: int = 512,
    windows: int = None,
    chunk_size: int = 128,
    ckpt_dir: str = None,
    tokenizer_path: str = None,
    no_kv_cache: bool = False,
    device: str = None,
    dtype: str = None,
    quantize: str = None,
    quant_kernels: str = "integer",
    json: bool = False,
    model: str = None,
    kv_cache_dtype: str = "auto",
):
    """Perplexity of a model over a UTF-8 text file: exp of the mean negative log-likelihood per token.

    The text's tokens are cut into consecutive windows of --ctx tokens (the remainder shorter than a window
    is left out); each window starts with bos where the tokenizer adds one, and only its second half is
    scored, so every scored token sees at least ctx/2 tokens before it. This is how llama.cpp's
    llama-perplexity scores, so figures from the two compare when the tokens are the same.

    Examples:
        llama-perplexity data/alice29.txt
        llama-perplexity data/alice29.txt --ctx 1024 --windows 10 --no-kv-cache --json

    Args:
        file: the UTF-8 text to score (also as the first argument).
        ctx: tokens per window (at least 4).
        windows: score only the first this many windows; default all.
        chunk_size: with the KV cache, each window is fed in chunks of this many tokens, each reading the
            keys and values of the chunks before it from the cache. Without it (--no-kv-cache) a window is
            one forward pass. Same perplexity either way.
        <model flags>
        <kv cache dtype flag>
        no_kv_cache: feed each window whole instead of in chunks through the KV cache.
        json: print one JSON object (perplexity, its standard error, tokens scored, per-window figures).
    """
    flags = model_flags(ckpt_dir, tokenizer_path, device, dtype, quantize, quant_kernels, model, kv_cache_dtype,
                        compile=False, no_compile=True)  # windows are prompts, and prompts run eagerly
    if file is None:
        fail("give the text file to score, e.g. llama-perplexity data/alice29.txt")
    try:
        check_ctx(ctx)
    except ValueError as e:
        fail(str(e))
    if windows is not None and windows < 1:
        fail(f"--windows must be at least 1, not {windows}")
    if chunk_size < 1:
        fail(f"--chunk-size must be at least 1, not {chunk_size}")
    path = Path(str(file))
    text = read_text(path)

    llama = build_from_flags(replace(flags, max_seq_len=ctx, max_batch_size=1))
    tokens = llama.tokenizer.encode(text, bos=False, eos=False)
    window_starts(len(tokens), ctx, windows)  # a text too short fails here, before any work
    main_rank = is_main_rank(llama)
    progress = ProgressPrinter(prefix="llama-perplexity: ") if main_rank else None
    result = perplexity(llama, tokens, ctx, kv_cache=not no_kv_cache, chunk_size=chunk_size,
                        max_windows=windows, progress=progress)
    if not main_rank:
        return
    if json:
        record = {"file": str(path), **result.to_dict(), "dtype": str(llama.model.norm.weight.dtype).removeprefix("torch."),
                  "quantize": quantize, "quant_kernels": llama.info.quant_kernels}
        print(jsonlib.dumps(record), flush=True)
        return
    print(f"perplexity: {result.perplexity:.4f} +/- {result.stderr:.4f}")
    print(f"scored {result.scored_tokens} of the text's {result.text_tokens} tokens in {result.windows} windows of "
          f"{ctx} (the second half of each), KV cache {'off' if no_kv_cache else 'on'}, "
          f"{result.seconds:.1f} s ({result.windows * ctx / result.seconds:.0f} tokens/s fed)")


def cli() -> None:
    run(main, "llama-perplexity")


if __name__ == "__main__":
    cli()
