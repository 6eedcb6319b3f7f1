"""Fetch LLaMA-2's real 32,000-piece vocabulary and llama.cpp's tokenizer test vectors for it.

Meta's `tokenizer.model` sits behind a license click-through, but llama.cpp ships the same vocabulary as a
vocab-only GGUF file (`ggml-vocab-llama-spm.gguf`) together with inputs and the ids Hugging Face's Llama-2
tokenizer gave for them. The llama-cpp-python source distribution on PyPI vendors those files, so pip can
fetch them wherever PyPI is reachable; `tokenizer.model` is then rebuilt from the GGUF vocabulary.
"""

import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import List, Optional, Tuple, Union

from llama.runtime import paths
from llama.convert.spm_from_gguf import write_sentencepiece_model
from llama.errors import LlamaError
from llama.convert.pip_fetch import pip_download
from llama.runtime.progress import Progress, or_silent, step

# Pinned so that the vocabulary and the expected ids never change under the tests.
_SDIST_PACKAGE = "llama-cpp-python"
SDIST_REQUIREMENT = f"{_SDIST_PACKAGE}==0.3.36"
_SDIST_BYTES = 76_589_250

VOCAB_GGUF = "ggml-vocab-llama-spm.gguf"
VOCAB_INP = VOCAB_GGUF + ".inp"
VOCAB_OUT = VOCAB_GGUF + ".out"
TOKENIZER_MODEL = "tokenizer.model"

# Where the three llama.cpp files sit inside the sdist, below its top-level `<name>-<version>/` folder.
_SDIST_MODELS_DIR = ("vendor", "llama.cpp", "models")
_FROM_SDIST = (VOCAB_GGUF, VOCAB_INP, VOCAB_OUT)
# tokenizer.model last: it is what makes a directory complete, so a crash mid-way leaves it incomplete.
_ALL_FILES = _FROM_SDIST + (TOKENIZER_MODEL,)

# The line llama.cpp's test-tokenizer-0 puts between inputs in a `.inp` file.
_INPUT_SEPARATOR = "\n__ggml_vocab_test__\n"


def default_vocab_dir() -> Path:
    """Where `fetch_llama2_vocab` keeps the files unless told otherwise."""
    return paths.home_dir() / "llama2-tokenizer"


def fetch_llama2_vocab(dest_dir: Optional[Union[str, os.PathLike]] = None,
                       progress: Optional[Progress] = None) -> Path:
    """Make sure a directory holds LLaMA-2's vocabulary, llama.cpp's test vectors and a `tokenizer.model`.

    When all four files are already there this returns at once without touching the network. Otherwise
    it downloads the llama-cpp-python source distribution with pip (about 77 MB), takes the three
    vocabulary files out of it, rebuilds `tokenizer.model` from the GGUF vocabulary, and moves the files
    into place.

    Args:
        dest_dir: the directory to fill; default `<llama home>/llama2-tokenizer` (see `llama.runtime.paths`).
        progress: told how each step goes (see `llama.runtime.progress`); None for silence.

    Returns:
        The directory, holding `ggml-vocab-llama-spm.gguf`, its `.inp` and `.out` files, and
        `tokenizer.model`.

    Raises:
        LlamaError: pip could not download the source distribution, or it lacks the vocabulary files.
    """
    dest = Path(dest_dir).expanduser() if dest_dir is not None else default_vocab_dir()
    if _is_complete(dest):
        return dest

    progress = or_silent(progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Staged beside dest so that the final moves are renames within one file system.
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-") as tmp:
        download_dir = Path(tmp) / "download"
        stage = Path(tmp) / "stage"
        stage.mkdir()

        sdist = pip_download(SDIST_REQUIREMENT, download_dir, "sdist", _SDIST_BYTES, progress)
        with step(progress, f"extracting {', '.join(_FROM_SDIST)} from {sdist.name}"):
            _extract_vocab_files(sdist, stage)
        with step(progress, f"building {TOKENIZER_MODEL} from {VOCAB_GGUF}"):
            write_sentencepiece_model(stage / VOCAB_GGUF, stage / TOKENIZER_MODEL)
        _move_into_place(stage, dest)
    return dest


def read_llama_cpp_vectors(
    directory: Union[str, os.PathLike], vocab_name: str = VOCAB_GGUF
) -> List[Tuple[str, List[int]]]:
    """Read llama.cpp's tokenizer test vectors: each input text with the ids expected for it.

    The format is test-tokenizer-0's: the `.inp` file holds the inputs, each followed by a line
    `__ggml_vocab_test__`; the `.out` file holds one line per input, its ids separated by spaces. The ids
    were made without adding special tokens, so they carry no bos.

    Args:
        directory: the folder holding `<vocab_name>.inp` and `<vocab_name>.out`.
        vocab_name: the GGUF file the vectors belong to.

    Returns:
        `(text, ids)` pairs in file order.

    Raises:
        LlamaError: a file is missing, or the two files disagree on the number of tests.
    """
    inp_path = Path(directory) / f"{vocab_name}.inp"
    out_path = Path(directory) / f"{vocab_name}.out"
    for path in (inp_path, out_path):
        if not path.is_file():
            raise LlamaError(f"test vector file {path} does not exist; run fetch_llama2_vocab() to get it")

    # Bytes, not text mode: inputs such as "\r" or "\n\n" must reach the tokenizer exactly as written.
    inputs = _split_inputs(inp_path.read_bytes().decode("utf-8"))
    out_lines = out_path.read_bytes().decode("utf-8").split("\n")
    if out_lines and out_lines[-1] == "":
        out_lines.pop()
    if len(inputs) != len(out_lines):
        raise LlamaError(
            f"{inp_path} has {len(inputs)} inputs but {out_path} has {len(out_lines)} lines of ids; "
            "fetch both files again from the same llama.cpp version"
        )
    return [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, out_lines)]


def _split_inputs(raw: str) -> List[str]:
    """Inputs from a `.inp` file, scanning for separators left to right as llama.cpp does."""
    inputs = []
    pos = 0
    while pos < len(raw):
        end = raw.find(_INPUT_SEPARATOR, pos)
        if end == -1:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:end])
        pos = end + len(_INPUT_SEPARATOR)
    return inputs


def _is_complete(directory: Path) -> bool:
    """Whether the directory already holds every file `fetch_llama2_vocab` provides."""
    return all((directory / name).is_file() for name in _ALL_FILES)


def _extract_vocab_files(sdist: Path, stage: Path) -> None:
    """Copy the three vocabulary files out of the sdist into `stage`, reading the archive once."""
    wanted = set(_FROM_SDIST)
    # Stream mode ("r|gz") reads members in order and stops as soon as the three are found, without
    # unpacking the rest of the ~77 MB archive.
    with tarfile.open(sdist, mode="r|gz") as archive:
        for member in archive:
            parts = PurePosixPath(member.name).parts
            # Match on the path below the top-level folder, and write under a name of our choosing, so
            # that no member path from the archive decides where a file lands.
            if not (member.isfile() and len(parts) == 5 and parts[1:4] == _SDIST_MODELS_DIR):
                continue
            name = parts[4]
            if name not in wanted:
                continue
            source = archive.extractfile(member)
            assert source is not None  # a regular file member always has content
            with source, open(stage / name, "wb") as target:
                shutil.copyfileobj(source, target)
            wanted.discard(name)
            if not wanted:
                return
    raise LlamaError(
        f"{sdist.name} has no {', '.join(sorted(wanted))} under {'/'.join(_SDIST_MODELS_DIR)}; "
        f"the pinned {SDIST_REQUIREMENT} should have them, so delete the download and try again"
    )


def _move_into_place(stage: Path, dest: Path) -> None:
    """Move the staged files to `dest`, as one directory rename when `dest` does not exist yet."""
    if not dest.exists():
        try:
            stage.rename(dest)
            return
        except OSError:
            # Another process created dest meanwhile; if it finished the job, its files are as good.
            if _is_complete(dest):
                return
    if not dest.is_dir():
        raise LlamaError(f"{dest} exists but is not a directory; remove it or pass another dest_dir")
    # dest holds some of the files already (an interrupted fetch, or files put there by hand): replace
    # each one atomically, tokenizer.model last, and leave anything else in the directory alone.
    for name in _ALL_FILES:
        os.replace(stage / name, dest / name)
