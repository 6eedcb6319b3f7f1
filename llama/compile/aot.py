"""The decode step compiled ahead of time: built once per model shape, stored under $LLAMA_HOME, loaded in milliseconds.

`torch.compile` compiles the step again in every process (seconds with Inductor's cache, minutes without).
Here the one-token step with the KV cache is exported (`torch.export`) with its positions as a tensor
(`Transformer.forward(input_pos=...)`, as the server's batched step feeds them) and the cache's length as a
symbolic size, then compiled by AOTInductor into a package of generated code without the weights, stored in
`$LLAMA_HOME/compiled/<key>/` (or `$LLAMA_COMPILED_DIR/<key>/`). A later process loads the package and hands
it the model's own tensors, uncopied.

The key covers everything the generated code depends on: the model's shape, the name, shape, dtype and
module class of every tensor (so the layer classes and the quantization), what the KV cache holds (the model's
dtype, another float dtype, or int8 rows of values and their scales' bytes), the batch size, the threads, this
torch, the CPU's vector instructions and the sources of this package. The weights' values are not part of it,
so one package serves every checkpoint of one shape. A package whose digest, metadata or load fails is built
again, never run.
"""

import copy
import json
import logging
import queue
import shutil
import sys
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from llama import kernels
from llama.compile.store import META, PACKAGE, compiled_dir, describe_key, package_dir, package_loader
from llama.errors import first_line
from llama.runtime.files import lock_file, read_json_object, sha256_file, write_atomically
from llama.kv_cache import KVCache, PagedKVCache
from llama.model import Transformer
from llama.runtime.progress import Progress, or_silent, step

# Caches of every length from 2 positions up share one package; generate() never decodes with a shorter one.
_MIN_CACHE, _MAX_CACHE = 2, 1 << 20
_BUILDING = threading.Lock()  # held while a package is exported and compiled
_LOCKS = ".locks"  # in the packages' directory: a lock file for each package, held by the process building it
# Python's switch interval while a step is built, on a background thread beside the eager steps: export is Python
# that lets go of the GIL only when made to, and an eager step takes the GIL back hundreds of times, waiting up to
# the interval each time (docs/benchmarks.md, "Figures behind the code", has what it costs and gains).
BUILD_SWITCH_INTERVAL_S = 2e-5
# The most tokens one step that verifies a speculative draft feeds (llama/speculative.py): its packages are one per count.
MAX_VERIFY_TOKENS = 17


def quiet_inductor() -> None:
    """Hold back Inductor's messages about its own choices, for the rest of the process: the rotations' complex
    table (`rope_cis`), and with the C++ wrapper some view ops, go through slower generic calls.
    That is its business, not the user's, and it would print them at every compilation."""
    logging.getLogger("torch._inductor.ir").setLevel(logging.ERROR)
    # "on error, temporary cache dir kept at ...": a failed build (no compiler) is reported in our own words.
    logging.getLogger("torch._inductor.utils").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
    # torch 2.15, where a bf16 step reads an int4 layer's float16 scales.
    warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")


class _DecodeStep(nn.Module):
    """What is exported: one token per row at its own position, written into per-layer caches given as tensors; or
    a few tokens of one row at consecutive positions (the draft a speculative step verifies), with every one's
    logits."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv: List[torch.Tensor]) -> torch.Tensor:
        caches = [KVCache.wrap(kv[i], kv[i + 1]) for i in range(0, len(kv), 2)]
        # The number of tokens is a constant of each package: this is Python's choice while exporting, not the step's.
        return self.model(tokens, cache=caches, input_pos=input_pos, num_logits=1 if tokens.shape[1] == 1 else None)


class _PagedDecodeStep(nn.Module):
    """What the server's step exports: one token per row at its own position, read and written through the rows'
    block tables in a paged pool given as tensors (llama/kv_cache.py's PagedKVCache)."""

    def __init__(self, model: Transformer, block_size: int):
        super().__init__()
        self.model = model
        self.block_size = block_size

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, tables: torch.Tensor,
                pool: List[torch.Tensor]) -> torch.Tensor:
        cache = PagedKVCache.wrap(pool[0::2], pool[1::2], self.block_size)
        return self.model(tokens, cache=cache.for_step(tables, input_pos), input_pos=input_pos, num_logits=1)




class Damaged(Exception):
    """A stored package that must not be run: its files are missing, edited or from other sources."""


class Unsupported(Exception):
    """The model holds tensors the package could not take from it at load (plain tensor attributes rather than
    parameters or buffers, as torch's bf16 int8/int4 kernels' layers keep): it cannot be compiled ahead of time."""


def _shadow(module: nn.Module, memo: Optional[Dict[int, torch.Tensor]] = None) -> nn.Module:
    """A copy of `module` for torch.export to trace: the same classes, names, shapes, strides and dtypes, its tensors
    new and never written (memory never touched costs nothing). Export swaps a module's tensors for its own while it
    traces, which the model itself, computing eager steps on another thread meanwhile, must not see.

    Every tensor is a parameter in the copy, buffers too: Inductor clones each buffer the step reads (in case the
    step writes it, which this one never does), which for a quantized model's buffers of weights would be a copy
    of the whole model in memory while the package is built. The package names its tensors as the model does, so
    the model's own parameters and buffers are handed to it at load all the same."""
    memo = {} if memo is None else memo

    def twin(t):
        if t is None:
            return None
        if id(t) not in memo:  # tied tensors stay tied
            memo[id(t)] = nn.Parameter(torch.empty_like(t), requires_grad=False)
        return memo[id(t)]

    clone = copy.copy(module)
    clone._parameters = {name: twin(t) for name, t in (*module._parameters.items(), *module._buffers.items())}
    clone._buffers = {}
    clone._non_persistent_buffers_set = set()
    clone._modules = {name: None if m is None else _shadow(m, memo) for name, m in module._modules.items()}
    return clone


class _StoredSteps:
    """Packages of one exported step of `model`, one per size (a batch size, or a range of them), loaded from
    disk or built and stored at first need. `notes` gathers what the user should hear (a rebuilt package).

    `runner(size)` waits for a package to be built; `ready(size)` never does: it loads a stored one, or has it built
    on a background thread while the caller runs the eager step, which gives the same results (tested)."""

    kind = ""  # of the step, in the key
    key_extra: Dict[str, object] = {}  # more of the key: what the exported code holds as constants

    def __init__(self, model: Transformer, module: nn.Module, kv_dtype: torch.dtype,
                 progress: Optional[Progress] = None):
        self.model = model
        self.kv_dtype = kv_dtype  # what the caches it takes hold: the model's dtype, another float dtype, or int8
        self.progress = or_silent(progress)
        self.notes: List[str] = []
        self.built: Dict[object, float] = {}  # seconds spent building each size's package in this process
        self.directories: Dict[object, Path] = {}  # where each size's package is stored
        self._runners: Dict[object, Callable] = {}
        self._module = module
        self._asked: set = set()  # sizes `ready` has been asked for
        self._queue: "queue.Queue" = queue.Queue()  # sizes waiting for the background thread
        self._worker: Optional[threading.Thread] = None
        self.failed: Dict[object, str] = {}  # sizes the background thread could not build, and why
        self._errors: Dict[object, Exception] = {}

    @property
    def build_seconds(self) -> float:
        """Seconds spent building packages in this process (0 when every one was loaded)."""
        return sum(self.built.values())

    def runner(self, size) -> Callable:
        """The loaded package for `size`: stored, or built and stored now (or, asked of `ready` before, by the
        background thread: waited for, since two exports at once would trip over each other in torch)."""
        if size not in self._runners and size in self._asked:
            if self.building:
                what = f"{self._example(size)[2]} (once per model shape; stored in {compiled_dir()})"
                with step(self.progress, what):
                    self.wait()
            if size in self._errors:
                raise self._errors[size]
        if size not in self._runners:
            self._runners[size] = self._load_or_build(size)
        return self._runners[size]

    def ready(self, size) -> Optional[Callable]:
        """The loaded package for `size` if it can be run now, else None. At the first call for a size a stored
        package is loaded (milliseconds); one that is not stored is built on a background thread, a size at a
        time, and this returns it from the first call after it is done.

        Raises:
            Unsupported: a stored verdict says that this model cannot be compiled ahead of time.
        """
        runner = self._runners.get(size)
        if runner is not None or size in self._asked:
            return runner
        self._asked.add(size)
        runner = self._stored(size)
        if runner is not None:
            self._runners[size] = runner
            return runner
        self._queue.put(size)
        if self._worker is None:
            self._worker = threading.Thread(target=self._build_queued, name="llama-compile", daemon=True)
            self._worker.start()
        return None

    @property
    def building(self) -> bool:
        """Whether the background thread has packages still to build."""
        return self._worker is not None and self._worker.is_alive() and self._queue.unfinished_tasks > 0

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the background thread has built what `ready` asked for; False if `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.building:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._worker.join(0.1)
        return True

    def _build_queued(self) -> None:
        while True:
            size = self._queue.get()
            try:
                # Silent: the eager steps meanwhile print their own output; `wait` is where a caller can say so.
                self._runners[size] = self._build_and_load(size, or_silent(None))
            except Exception as e:  # Unsupported, or Inductor's failures (a bad toolchain): the eager step stays
                self.failed[size] = first_line(e)
                self._errors[size] = e
            finally:
                self._queue.task_done()

    def _example(self, size):
        """(example inputs, dynamic_shapes, what the progress line says) to export the step for `size`."""
        raise NotImplementedError

    def _place(self, size):
        fields = describe_key(self.model, list(size) if isinstance(size, tuple) else size, self.kind, self.key_extra,
                              self.kv_dtype)
        directory = self.directories[size] = package_dir(fields)
        return fields, directory

    def stored(self, size) -> bool:
        """Whether a package for `size` is loaded or stored (not necessarily undamaged)."""
        return size in self._runners or self._place(size)[1].exists()

    def _stored(self, size) -> Optional[Callable]:
        """The stored package for `size`, loaded; None where there is none (a damaged one is removed, with a note)."""
        fields, directory = self._place(size)
        if directory.exists():
            try:
                return self._load(directory, fields)
            except Damaged as e:
                self.notes.append(f"the stored compiled step in {directory} was not used ({e}); it was built again")
                shutil.rmtree(directory, ignore_errors=True)
        return None

    def _build_and_load(self, size, progress: Optional[Progress] = None) -> Callable:
        fields, directory = self._place(size)
        start = time.perf_counter()
        if self._build(directory, fields, *self._example(size), progress=progress):
            self.built[size] = time.perf_counter() - start
        return self._load(directory, fields)

    def _load_or_build(self, size) -> Callable:
        runner = self._stored(size)
        return runner if runner is not None else self._build_and_load(size)

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
        if not package.is_file() or sha256_file(package) != meta.get("sha256"):
            raise Damaged(f"{PACKAGE} is missing or does not match its digest")
        try:
            loader = package_loader(package)
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
            raise Damaged(f"it failed to load: {first_line(e)}") from e
        # Inputs flat, in the exported order; the Python wrapper would parse its call spec at every step.
        return lambda tokens, input_pos, kv: loader.run([tokens, input_pos, *kv])[0]

    def _build(self, directory: Path, fields: Dict[str, object], args: tuple, dynamic_shapes: tuple, what: str,
               progress: Optional[Progress] = None) -> bool:
        """Export and compile the step into a new directory beside `directory`, then rename it into place; one build
        at a time in a process (two models' steps, a draft model's beside the model's, would otherwise be exported
        at once, and torch's export is not safe to run on two threads), and one process at a time for a package (a
        lock file each: a second process waits for the first one's package, minutes of a core not spent twice).
        False where another process stored it meanwhile: nothing was built here."""
        progress = progress or self.progress

        def waiting():
            return step(progress, f"{what}: another process is building it; waiting for its package")

        with _BUILDING, lock_file(directory.parent / _LOCKS / directory.name, waiting):
            if directory.exists():
                return False
            interval = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, BUILD_SWITCH_INTERVAL_S))
            try:
                self._build_now(directory, fields, args, dynamic_shapes, what, progress)
            finally:
                sys.setswitchinterval(interval)
        return True

    def _build_now(self, directory: Path, fields: Dict[str, object], args: tuple, dynamic_shapes: tuple, what: str,
                   progress: Optional[Progress] = None) -> None:
        import torch._inductor  # only to build: loading a package needs none of it

        quiet_inductor()
        directory.parent.mkdir(parents=True, exist_ok=True)
        what = f"{what} (once per model shape; stored in {directory.parent})"
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        unsupported = None
        try:
            # torch's own deprecation warnings from inside export and Inductor are not the user's business.
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore", FutureWarning)
                exported = torch.export.export(_shadow(self._module), args, strict=False, dynamic_shapes=dynamic_shapes)
                if exported.constants:
                    unsupported = (f"the step holds {len(exported.constants)} tensors that are not the model's "
                                   "parameters or buffers")
                    meta = {"key": fields, "unsupported": unsupported}  # remembered: no later run exports again
                else:
                    with step(progress or self.progress, what), \
                            torch._inductor.config.patch({"aot_inductor.package_constants_in_so": False,
                                                          "aot_inductor.custom_ops_to_c_shims": kernels.c_shims()}):
                        torch._inductor.aoti_compile_and_package(exported, package_path=str(staging / PACKAGE))
                    meta = {"key": fields, "sha256": sha256_file(staging / PACKAGE),
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


class AheadOfTimeStep(_StoredSteps):
    """The cached steps of `model` through stored packages, built at first need: the one-token step, one package per
    batch size (a size `n`), and the step that verifies a speculative draft, `tokens` tokens of one row with every
    one's logits, one package per number of tokens (a size `(1, tokens)`).

    Called as `compile.Step` is (tokens, start_pos, cache, num_logits); `accepts` says whether a call is of either kind.
    """

    kind = "decode"

    def __init__(self, model: Transformer, progress: Optional[Progress] = None):
        super().__init__(model, _DecodeStep(model), model.kv_cache_dtype, progress)
        # `_cache_inputs`' last result for a cache, by the cache's first layer: weakly, so that a finished decode's
        # cache is freed when its caller lets go of it, not held until the next decode has allocated its own.
        self._kept_inputs: "weakref.WeakKeyDictionary[KVCache, tuple]" = weakref.WeakKeyDictionary()

    @staticmethod
    def size_of(tokens: torch.Tensor):
        """The package a call with these tokens runs: its batch size for one token a row, (1, seqlen) for more."""
        return tokens.shape[0] if tokens.shape[1] == 1 else (1, tokens.shape[1])

    def accepts(self, tokens: torch.Tensor, cache, num_logits: Optional[int]) -> bool:
        bsz, seqlen = tokens.shape
        shape_fits = ((seqlen == 1 and num_logits in (None, 1))
                      or (bsz == 1 and 1 < seqlen <= MAX_VERIFY_TOKENS and num_logits in (None, seqlen)))
        return (cache is not None and shape_fits and self._cache_inputs(cache, bsz) is not None
                and cache[0].max_seq_len >= max(_MIN_CACHE, seqlen + 1))

    def __call__(self, tokens: torch.Tensor, start_pos: int, cache: List[KVCache], num_logits: Optional[int] = None,
                 runner: Optional[Callable] = None):
        bsz, seqlen = tokens.shape
        runner = runner or self.runner(self.size_of(tokens))
        input_pos = torch.arange(start_pos, start_pos + seqlen, device=tokens.device).expand(bsz, seqlen)
        # The package reads its inputs with the strides it was compiled for, unchecked: contiguous ones. generate()
        # feeds a column of its token buffer, whose rows lie a whole buffer row apart.
        return runner(tokens.contiguous(), input_pos.contiguous(), self._cache_inputs(cache, bsz))

    def _cache_inputs(self, cache, bsz: int) -> Optional[List[torch.Tensor]]:
        """The package's cache inputs, each layer's keys and values of the first `bsz` rows; None where the package
        cannot read `cache` (another cache class or dtype, strides it was not built for). Kept from the last call
        while the cache holds the same tensors, as a decode's steps do: working them out at every step cost a
        share of a short step (docs/benchmarks.md, "Figures behind the code")."""
        if not cache or not all(type(c) is KVCache for c in cache):
            return None
        tensors = [t for c in cache for t in (c._buffers["cache_k"], c._buffers["cache_v"])]
        kept = self._kept_inputs.get(cache[0])
        if kept is not None and kept[0] == bsz and len(kept[1]) == len(tensors) \
                and all(a is b for a, b in zip(kept[1], tensors)):
            return kept[2]
        if not all(t.is_contiguous() and (i % 2 or t.dtype == self.kv_dtype) for i, t in enumerate(tensors)):
            return None
        inputs = [t[:bsz] for t in tensors]
        self._kept_inputs[cache[0]] = (bsz, tensors, inputs)
        return inputs

    def _place(self, size):
        if not isinstance(size, tuple):
            return super()._place(size)
        fields = describe_key(self.model, 1, "verify", {"tokens": size[1]}, self.kv_dtype)
        directory = self.directories[size] = package_dir(fields)
        return fields, directory

    def _example(self, size):
        batch_size, seqlen = (size, 1) if not isinstance(size, tuple) else size
        cache = self.model.new_kv_cache(batch_size, 8 + seqlen, self.kv_dtype)  # int8: rows wider than head_dim
        kv = [t for c in cache for t in (c.cache_k, c.cache_v)]
        tokens = torch.zeros((batch_size, seqlen), dtype=torch.long, device=self.model.device)
        input_pos = torch.arange(3, 3 + seqlen, device=self.model.device).expand(batch_size, seqlen).contiguous()
        length = torch.export.Dim("cache_len", min=max(_MIN_CACHE, seqlen + 1), max=_MAX_CACHE)
        what = (f"compiling the decode step for batch size {batch_size}" if seqlen == 1
                else f"compiling the step that checks {seqlen - 1} drafted tokens")
        return (tokens, input_pos, kv), (None, None, [{2: length}] * len(kv)), what


# The server's batch sizes, in the ranges one package each serves: the linear layers take one path per range
# (llama/quant/linears.py: llama_kv.f32_linear up to FEW_ROWS_MAX rows, GEMM above), and one row has a package whose
# sizes are all fixed.
_PAGED_RANGES = ((1, 1), (2, 16), (17, 1 << 16))


class PagedStep(_StoredSteps):
    """The server's decode step (one token per row, each at its own position, through block tables into a paged
    pool, llama/kv_cache.py) through stored packages, one per range of batch sizes, each serving any block-table
    width and pool size. Called with (tokens, input_pos, tables); `pool` is the PagedKVCache it reads and writes.
    """

    kind = "paged"

    def __init__(self, model: Transformer, pool: PagedKVCache, progress: Optional[Progress] = None):
        super().__init__(model, _PagedDecodeStep(model, pool.block_size), pool.dtype, progress)
        self.key_extra = {"block_size": pool.block_size}  # a constant in the generated code's index arithmetic
        self.pool = pool
        self._tensors = [t for k, v in zip(pool.keys, pool.values) for t in (k, v)]

    @staticmethod
    def size_range(batch_size: int):
        return next(r for r in _PAGED_RANGES if r[0] <= batch_size <= r[1])

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor, tables: torch.Tensor,
                 runner: Optional[Callable] = None) -> torch.Tensor:
        runner = runner or self.runner(self.size_range(tokens.shape[0]))
        return runner(tokens.contiguous(), input_pos.contiguous(), [tables.contiguous(), *self._tensors])

    def _example(self, size):
        low, high = size
        rows = max(low, min(high, 3))  # not 1 where the range is wider: export would take 1 for a constant
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=self.model.device)  # noqa: E731
        tokens, input_pos, tables = zeros(rows, 1), zeros(rows, 1), zeros(rows, 3)
        batch = None if low == high else torch.export.Dim("batch", min=low, max=high)
        width = torch.export.Dim("blocks", min=2, max=1 << 16)
        positions = torch.export.Dim("pool", min=2, max=1 << 30)
        row = {0: batch} if batch is not None else None
        return ((tokens, input_pos, tables, self._tensors),
                (row, row, {0: batch, 1: width} if batch is not None else {1: width},
                 [{1: positions}] * len(self._tensors)),
                f"compiling the server's decode step for batch sizes {low}-{high}" if low != high
                else "compiling the server's decode step for one row")
