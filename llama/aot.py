"""The decode step compiled ahead of time: built once per model shape, stored under $LLAMA_HOME, loaded in milliseconds.

`torch.compile` compiles the step again in every process (seconds with Inductor's cache, minutes without).
Here the one-token step with the KV cache is exported (`torch.export`) with its positions as a tensor
(`Transformer.forward(input_pos=...)`, as the server's batched step feeds them) and the cache's length as a
symbolic size, then compiled by AOTInductor into a package of generated code without the weights, stored in
`$LLAMA_HOME/compiled/<key>/` (or `$LLAMA_COMPILED_DIR/<key>/`). A later process loads the package and hands
it the model's own tensors, uncopied.

The key covers everything the generated code depends on: the model's shape, the name, shape, dtype and
module class of every tensor (so the layer classes and the quantization), the batch size, the threads, this
torch, the CPU's vector instructions and the sources of this package. The weights' values are not part of it,
so one package serves every checkpoint of one shape. A package whose digest, metadata or load fails is built
again, never run.
"""

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from llama.files import read_json_object, write_atomically
from llama.kv_cache import KVCache
from llama.model import Transformer
from llama.paths import home_dir
from llama.progress import Progress, or_silent, step

DIR_ENV = "LLAMA_COMPILED_DIR"
FORMAT = 1  # of the entries: a new one makes every older entry a stranger, built anew
PACKAGE = "step.pt2"
META = "meta.json"
# Caches of every length from 2 positions up share one package; generate() never decodes with a shorter one.
_MIN_CACHE, _MAX_CACHE = 2, 1 << 20
_SOURCES = Path(__file__).resolve().parent


def quiet_inductor() -> None:
    """Hold back Inductor's messages about its own choices, for the rest of the process: the rotary
    embedding's complex product, and with the C++ wrapper some view ops, go through slower generic calls.
    That is its business, not the user's, and it would print them at every compilation."""
    logging.getLogger("torch._inductor.ir").setLevel(logging.ERROR)
    # "on error, temporary cache dir kept at ...": a failed build (no compiler) is reported in our own words.
    logging.getLogger("torch._inductor.utils").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
    # torch 2.15, where a bf16 step reads an int4 layer's float16 scales.
    warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")


class _DecodeStep(nn.Module):
    """What is exported: one token per row at its own position, written into per-layer caches given as tensors."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv: List[torch.Tensor]) -> torch.Tensor:
        caches = [KVCache.wrap(kv[i], kv[i + 1]) for i in range(0, len(kv), 2)]
        return self.model(tokens, cache=caches, input_pos=input_pos, num_logits=1)


def compiled_dir() -> Path:
    """Where packages live: $LLAMA_COMPILED_DIR if set (the tests keep theirs apart so), else $LLAMA_HOME/compiled."""
    return Path(os.environ[DIR_ENV]).expanduser() if os.environ.get(DIR_ENV) else home_dir() / "compiled"


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_SOURCES.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h", ".inc") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_SOURCES)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def describe_key(model: Transformer, batch_size: int) -> Dict[str, object]:
    """What a package for `model` at `batch_size` depends on, as the fields its metadata records."""
    from llama.kernels.build import cpu_key

    params = {k: v for k, v in asdict(model.params).items() if k not in ("max_seq_len", "max_batch_size")}
    tensors = hashlib.sha256()
    for name, module in model.named_modules():
        tensors.update(f"{name}:{type(module).__module__}.{type(module).__qualname__}\n".encode())
        for tname, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            tensors.update(f"  {tname}:{tuple(t.shape)}:{t.dtype}\n".encode())
    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "device": str(model.device.type),
        "cpu": cpu_key(),  # the vector instructions Inductor chooses from
        "threads": torch.get_num_threads(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "batch_size": batch_size,
        "params": params,
        "modules": tensors.hexdigest()[:16],
        "sources": _sources_digest(),
    }


def _key(fields: Dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _package_loader(package: Path):
    """The package's loader from torch's C++ runtime, without importing Inductor (a second of every start-up)."""
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
    except TypeError:  # another torch, another constructor: its Python wrapper knows it
        from torch._inductor.package import load_package

        return load_package(str(package)).loader


class Damaged(Exception):
    """A stored package that must not be run: its files are missing, edited or from other sources."""


class Unsupported(Exception):
    """The model holds tensors the package could not take from it at load (plain tensor attributes rather than
    parameters or buffers, as torch's bf16 int8/int4 kernels' layers keep): it cannot be compiled ahead of time."""


class AheadOfTimeStep:
    """The one-token cached step of `model` through stored packages, one per batch size, built at first need.

    Called as `compile.Step` is (tokens, start_pos, cache, num_logits) for one token per row with a `KVCache`;
    `accepts` says whether a call is of that kind. `notes` gathers what the user should hear (a rebuilt package).
    """

    def __init__(self, model: Transformer, progress: Optional[Progress] = None):
        self.model = model
        self.progress = or_silent(progress)
        self.notes: List[str] = []
        self.built: Dict[int, float] = {}  # seconds spent building each batch size's package in this process
        self._runners: Dict[int, Callable] = {}
        self.directories: Dict[int, Path] = {}  # where each batch size's package is stored
        self._module = _DecodeStep(model)

    @staticmethod
    def accepts(tokens: torch.Tensor, cache, num_logits: Optional[int]) -> bool:
        return (cache is not None and tokens.shape[1] == 1 and num_logits in (None, 1)
                and all(type(c) is KVCache and c.cache_k.is_contiguous() and c.cache_v.is_contiguous() for c in cache)
                and cache[0].max_seq_len >= _MIN_CACHE)

    def __call__(self, tokens: torch.Tensor, start_pos: int, cache: List[KVCache], num_logits: Optional[int] = None):
        runner = self.runner(tokens.shape[0])
        input_pos = torch.full((tokens.shape[0], 1), start_pos, dtype=torch.long, device=tokens.device)
        kv = [t for c in cache for t in (c.cache_k[: tokens.shape[0]], c.cache_v[: tokens.shape[0]])]
        # The package reads its inputs with the strides it was compiled for, unchecked: contiguous ones. generate()
        # feeds a column of its token buffer, whose rows lie a whole buffer row apart.
        return runner(tokens.contiguous(), input_pos, kv)

    @property
    def build_seconds(self) -> float:
        """Seconds spent building packages in this process (0 when every one was loaded)."""
        return sum(self.built.values())

    def runner(self, batch_size: int) -> Callable:
        """The loaded package for `batch_size`: stored, or built and stored now."""
        if batch_size not in self._runners:
            self._runners[batch_size] = self._load_or_build(batch_size)
        return self._runners[batch_size]

    def _load_or_build(self, batch_size: int) -> Callable:
        fields = describe_key(self.model, batch_size)
        directory = self.directories[batch_size] = compiled_dir() / _key(fields)
        if directory.exists():
            try:
                return self._load(directory, fields)
            except Damaged as e:
                self.notes.append(f"the stored compiled step in {directory} was not used ({e}); it was built again")
                shutil.rmtree(directory, ignore_errors=True)
        start = time.perf_counter()
        self._build(directory, fields, batch_size)
        self.built[batch_size] = time.perf_counter() - start
        return self._load(directory, fields)

    def _load(self, directory: Path, fields: Dict[str, object]) -> Callable:
        try:
            meta = read_json_object(directory / META)
        except Exception as e:  # LlamaError for bad JSON, OSError for an unreadable file
            raise Damaged(f"its {META} cannot be read") from e
        if meta.get("key") != fields:
            raise Damaged(f"its {META} describes another model, torch or CPU")
        if "unsupported" in meta:  # an earlier run found that this model cannot be compiled ahead of time
            raise Unsupported(str(meta["unsupported"]))
        package = directory / PACKAGE
        if not package.is_file() or _file_digest(package) != meta.get("sha256"):
            raise Damaged(f"{PACKAGE} is missing or does not match its digest")
        try:
            loader = _package_loader(package)
            tensors = dict(self._module.named_parameters())
            tensors.update(self._module.named_buffers())
            names = loader.get_constant_fqns()
            if set(names) - set(tensors):
                raise Damaged(f"it needs tensors the model does not have ({sorted(set(names) - set(tensors))[:3]})")
            # The model's own tensors, not copies: the package reads the weights where they already are.
            loader.load_constants({n: tensors[n] for n in names}, False, True, True)  # active, all, user-managed
        except Damaged:
            raise
        except Exception as e:  # a damaged zip, a library that will not load: many exception types
            raise Damaged(f"it failed to load: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e
        # Inputs flat, in the exported order; the Python wrapper would parse its call spec at every step.
        return lambda tokens, input_pos, kv: loader.run([tokens, input_pos, *kv])[0]

    def _build(self, directory: Path, fields: Dict[str, object], batch_size: int) -> None:
        """Export and compile the step into a new directory beside `directory`, then rename it into place."""
        import torch._inductor  # only to build: loading a package needs none of it

        quiet_inductor()
        directory.parent.mkdir(parents=True, exist_ok=True)
        cache = self.model.new_kv_cache(batch_size, 8)
        kv = [t for c in cache for t in (c.cache_k, c.cache_v)]
        tokens = torch.zeros((batch_size, 1), dtype=torch.long, device=self.model.device)
        input_pos = torch.full((batch_size, 1), 3, dtype=torch.long, device=self.model.device)
        length = torch.export.Dim("cache_len", min=_MIN_CACHE, max=_MAX_CACHE)
        what = f"compiling the decode step for batch size {batch_size} (once per model shape; stored in {directory.parent})"
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        unsupported = None
        try:
            # torch's own deprecation warnings from inside export and Inductor are not the user's business.
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore", FutureWarning)
                exported = torch.export.export(self._module, (tokens, input_pos, kv), strict=False,
                                               dynamic_shapes=(None, None, [{2: length}] * len(kv)))
                if exported.constants:
                    unsupported = (f"the step holds {len(exported.constants)} tensors that are not the model's "
                                   "parameters or buffers")
                    meta = {"key": fields, "unsupported": unsupported}  # remembered: no later run exports again
                else:
                    with step(self.progress, what), \
                            torch._inductor.config.patch({"aot_inductor.package_constants_in_so": False}):
                        torch._inductor.aoti_compile_and_package(exported, package_path=str(staging / PACKAGE))
                    meta = {"key": fields, "sha256": _file_digest(staging / PACKAGE),
                            "built": time.strftime("%Y-%m-%d %H:%M:%S")}
            write_atomically(staging / META, json.dumps(meta, indent=1))
            try:
                staging.rename(directory)
            except OSError:  # another process stored the same package first: theirs is as good
                if not directory.exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if unsupported:
            raise Unsupported(unsupported)
