"""The compiled decode steps, `Llama`'s and llama-server's: compilation applied to a built model from outside.

Only the steps after the prompt are compiled (one token with the KV cache, the growing prefix without it);
the prompt runs eagerly, so a new prompt length never costs a compilation. On the CPU the one-token step
with the cache, the one every cached generation spends its time in, comes compiled ahead of time from a
package stored under $LLAMA_HOME (llama/compile/aot.py): built once per model shape and batch size, then loaded in
milliseconds by every later process. The rest (the uncached step, and every step on a GPU) goes through
torch.compile, with positions, the KV cache's length and (without the cache) the prefix length compiled as
symbolic sizes, so one compilation serves every step of every later call with the same batch size.

llama-server's step (`compile_paged_step`) is the one-token step of many rows at their own positions over the
paged KV cache, from stored packages on the CPU as well. One `Step` serves both, and follows one rule: "auto" (the
default) takes the stored step where it can be had and runs eagerly otherwise, with a note saying why; True
compiles or fails.
"""

import atexit
import os
import re
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import nn

from llama.compile import store
from llama.compile.aot import AheadOfTimeStep, PagedStep, Unsupported, quiet_inductor
from llama.kernels import build
from llama.errors import LlamaError, first_line
from llama.kv_cache import KVCache, PagedKVCache
from llama.model import Transformer
from llama.runtime.progress import Progress, or_silent, step as progress_step

# Sources (the compiled forward's arguments, as Dynamo names them) whose values change from step to step.
# Left static, each new value would trigger a compilation, each of them slow (docs/benchmarks.md).
_DYNAMIC_SOURCES = ",".join([
    re.escape("L['start_pos']"),
    re.escape("L['tokens']") + ":1",  # the prefix fed without a cache (1 with it, which stays static)
    re.escape("L['cache']") + r".*_buffers\['cache_[kv]'\]:2",  # the cache's length, new for each call
])


# Compilations Dynamo keeps for the model's forward, across every compiled model in the process. Each kind of
# step (with or without the cache, a batch size, float or quantized layers) is one; the default of 8 is
# reached by a process that compiles a float, an int8 and an int4 model, as a benchmark comparing them does,
# or that builds a compiled model and then serves it (llama/server/runner.py). With fullgraph=True, passing the
# limit is an error, not a slower eager step.
RECOMPILE_LIMIT = 64
# What `compile` means where it is not given (Llama.build, every command): "0" eager, "1" compile=True, unset or
# "auto" the stored step wherever it can be had.
COMPILE_ENV = "LLAMA_COMPILE"


def default_compile() -> Union[bool, str]:
    """compile= when not given: "auto" unless $LLAMA_COMPILE says 0 (False) or 1 (True)."""
    value = os.environ.get(COMPILE_ENV, "auto")
    if value not in ("0", "1", "auto"):
        raise LlamaError(f"{COMPILE_ENV} must be 0, 1 or auto, not {value!r}")
    return "auto" if value == "auto" else value == "1"


def eager_note(reason: str) -> str:
    """The note of the default ("auto") where the step could not be compiled."""
    return (f"the decode step could not be compiled ({reason}); the decode step runs eagerly, about 3 times slower "
            "(compile=False hides this note)")


def kv_cache_dtype_note(kv_dtype: torch.dtype, explicit: bool, stored_step: bool) -> Optional[str]:
    """Where the KV cache holds keys and values in another dtype than the model computes in (int8, or bf16 for a
    float32 model): None where the decode step still compiles, which the stored steps do (`stored_step`: on the CPU,
    llama/compile/store.py `used`, a package per cache dtype). Elsewhere (torch.compile: a GPU, LLAMA_COMPILE_AOT=0) the
    decode step runs eagerly: the note that says so, or with `explicit` (compile=True) a LlamaError."""
    if stored_step:
        return None
    name = str(kv_dtype).removeprefix("torch.")
    if explicit:
        raise LlamaError(f"compile=True compiles the decode step over a KV cache in another dtype than the model's "
                         f"(kv_cache_dtype={name}) only through the stored step on the CPU; leave out one of them")
    return (f"with kv_cache_dtype={name} the decode step runs eagerly here, about 3 times slower (only the stored "
            "compiled step on the CPU takes keys and values in another dtype than the model's; compile=False hides "
            "this note)")


def _no_compiler(kernels: bool = True) -> Optional[str]:
    """Why no package can be built here (no C++ compiler), in a few words; None where one can. `kernels`: what the
    integer kernels' build lacks counts too (the default mode's check); else only the compiler."""
    reason = build.missing() if kernels else build.missing_compiler()
    return None if reason is None else f"the stored step is built with a C++ compiler: {reason}"


class CompileFailed(LlamaError):
    """The step could not be compiled; `reason` says why in a few words (the message adds what to do)."""

    def __init__(self, reason: str, hint: str = ""):
        super().__init__(f"compile=True failed: the decode step could not be compiled ({reason}); "
                         f"run without compile=True{hint}")
        self.reason = reason


class Step:
    """A model's decode step, the steps after the prompt, compiled as the run plan names it; it shares the model's
    weights. `Llama` calls it over a static cache (`__call__`); llama-server's runner calls `paged` for one token per
    row over the paged pool `pool`, each row at its own position. It is the one place that decides, step by step,
    what runs: the stored package where the plan's step is "stored" (`ahead_of_time`, on the CPU), torch.compile for
    the steps no package takes, or with `eager_otherwise` (compile="auto") the model's own eager step, which gives
    the same bits, wherever no package is ready yet (one being built in the background runs from the first step
    after it is).
    """

    def __init__(self, model: Transformer, progress: Optional[Progress] = None, eager_otherwise: bool = False,
                 stored: bool = False, pool: Optional[PagedKVCache] = None):
        self.model = model
        self.pool = pool
        self.eager_otherwise = eager_otherwise  # steps the package does not take run eagerly, not torch.compile'd
        self._compiled = None  # torch.compile's, made at its first use: making it imports Inductor (seconds)
        # On the CPU the step's kernels are called from generated C++ rather than Python: more tokens/s, the most
        # where the step is shortest, for a longer first compilation (scripts/compare_compiled.py; figures in
        # docs/benchmarks.md). LLAMA_COMPILE_CPP_WRAPPER=0 turns it off, to measure the difference or to work
        # around a torch bug.
        self._cpp_wrapper = (model.device.type == "cpu"
                             and os.environ.get("LLAMA_COMPILE_CPP_WRAPPER", "1") != "0")
        self.ahead_of_time: Union[AheadOfTimeStep, PagedStep, None] = None
        if stored:
            self.ahead_of_time = AheadOfTimeStep(model, progress) if pool is None else PagedStep(model, pool, progress)

    def _package(self, size) -> Optional[Callable]:
        """The stored package that runs a step of `size` now, or None: compile=True waits for it (built now where none
        is stored); the default takes it once it is ready. A model no package can hold drops the packages for good."""
        try:
            return self.ahead_of_time.runner(size) if not self.eager_otherwise else self.ahead_of_time.ready(size)
        except Unsupported:
            self.ahead_of_time = None  # every step goes the other ways from here on
            return None

    def __call__(self, tokens: torch.Tensor, start_pos: int, cache: Optional[List[KVCache]],
                 num_logits: Optional[int] = None) -> torch.Tensor:
        ahead = self.ahead_of_time
        if ahead is not None and ahead.accepts(tokens, cache, num_logits):
            runner = self._package(ahead.size_of(tokens))
            if runner is not None:
                return ahead(tokens, start_pos, cache, num_logits, runner=runner)
        if self.eager_otherwise:
            return self.model(tokens, start_pos, cache, num_logits=num_logits)
        if self._compiled is None:
            self._compiled = torch.compile(self.model, fullgraph=True)
            quiet_inductor()
        with torch.compiler.config.patch(dynamic_sources=_DYNAMIC_SOURCES), \
                torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                torch._inductor.config.patch(cpp_wrapper=self._cpp_wrapper):
            return self._compiled(tokens, start_pos, cache, num_logits=num_logits)

    def paged(self, tokens: torch.Tensor, input_pos: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The last position's logits of one token per row over the paged pool, each row at its position in
        `input_pos` through its block table in `tables` (tokens and positions (rows, 1), tables (rows, width))."""
        ahead = self.ahead_of_time
        if ahead is not None:
            runner = self._package(PagedStep.size_range(tokens.shape[0]))
            if runner is not None:
                return ahead(tokens, input_pos, tables, runner=runner)
        elif not self.eager_otherwise:
            if self._compiled is None:
                self._compiled = torch.compile(self._paged_decode, dynamic=True, fullgraph=True)
                quiet_inductor()
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):  # one limit for the whole process
                return self._compiled(tokens, input_pos, tables)
        return self._paged_decode(tokens, input_pos, tables)

    def _paged_decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, cache=self.pool.for_step(tables, input_pos), input_pos=input_pos, num_logits=1)

    @property
    def building(self) -> bool:
        """Whether packages are being built in the background (the eager step runs until each is ready)."""
        return self.ahead_of_time is not None and self.ahead_of_time.building

    def verifies(self, n_tokens: int, cache: List[KVCache]) -> bool:
        """Whether the step that feeds `n_tokens` tokens of one row, with every one's logits, runs compiled now: the
        step a speculative draft is verified with (llama/speculative.py), worth it only compiled.

        compile=True: yes, wherever a stored package can take it (built now where there is none). The default,
        "auto": yes once its package is loaded; a package not stored yet is built in the background, after the
        builds already queued, and stored when the process ends, as the one-token step's is."""
        ahead = self.ahead_of_time
        probe = torch.empty((1, n_tokens), dtype=torch.long)
        if ahead is None or not ahead.accepts(probe, cache, n_tokens):
            return not self.eager_otherwise and ahead is None  # torch.compile takes any step
        size = ahead.size_of(probe)
        try:
            if not self.eager_otherwise:
                ahead.runner(size)
                return True
            if ahead.ready(size) is not None:
                return True
        except Unsupported:
            self.ahead_of_time = None
            return False
        if ahead.building and not any(s is self for s, _ in _unfinished):
            _unfinished.append((self, ahead.progress))
        return False

    def describe_origin(self) -> str:
        """How the step came to be, for --stats: "ahead of time, loaded from disk" or "built and stored",
        "ahead of time, being built" (the eager step runs meanwhile), "torch.compile", or "eager" where nothing
        could be compiled."""
        if self.ahead_of_time is None:
            return "eager" if self.eager_otherwise else "torch.compile"
        if self.ahead_of_time.building:
            return "ahead of time, being built in the background; the eager step runs until it is ready"
        return "ahead of time, " + ("built and stored" if self.ahead_of_time.build_seconds else "loaded from disk")

    def finish(self, progress: Optional[Progress] = None) -> None:
        """Wait for the packages being built in the background to be stored, so that later processes load them;
        told to `progress` as the build is (the commands print it; the library says nothing). KeyboardInterrupt leaves them unbuilt: a later process builds them (a
        package is written under a temporary name, then renamed, so none is ever read half-written)."""
        ahead = self.ahead_of_time
        if ahead is None or not ahead.building:
            return
        what = (f"storing the compiled decode step for later runs (once per model shape, in {store.compiled_dir()}; "
                "Ctrl-C skips it)")
        try:
            with progress_step(or_silent(progress), what):
                ahead.wait()
        except KeyboardInterrupt:
            return

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the packages being built in the background (none: at once); False if `timeout` seconds passed."""
        return self.ahead_of_time is None or self.ahead_of_time.wait(timeout)

    @property
    def notes(self) -> List[str]:
        return self.ahead_of_time.notes if self.ahead_of_time is not None else []


# Steps whose packages are being built in the background, with the progress to tell: finished before the process
# ends (`finish_background_builds`), so that later processes load them.
_unfinished: List[tuple] = []


@atexit.register
def finish_background_builds() -> None:
    """Wait for every package still being built in the background (each says so on its progress, or on stderr).
    Runs at exit; a command that ends with os._exit calls it first."""
    while _unfinished:
        step, progress = _unfinished.pop()
        step.finish(progress)


def compile_step(model: Transformer, progress: Optional[Progress] = None, eager_otherwise: bool = False,
                 batch_size: int = 1, stored: Optional[bool] = None) -> Step:
    """A compiled version of `model.forward` for the steps after the prompt; it shares the model's weights.

    The model should be loaded for it (`Llama.build(compile=...)`): its layers planned for a compiled step
    (llama/quant/layer_plan.py), which its eager steps run too, and its float weights row-major, as the reductions
    read them; a model loaded otherwise is compiled as it is. The one-token step at `batch_size` is ready when
    this returns: on the CPU loaded from its stored package (built and stored first if there is none, reported
    to `progress`), on a GPU compiled (at batch 1). Other batch sizes, and the uncached step, are made at their
    first call.

    With `eager_otherwise` (compile="auto") nothing goes to torch.compile: the steps the package does not
    take, and all of them where there is none (a GPU, layers it cannot hold), run eagerly. `stored`: whether the
    one-token step comes from stored packages, as the run plan decided (`RunPlan.step`); None: wherever they can be
    used here (llama/compile/store.py `used`).

    Raises:
        CompileFailed: the step could not be compiled (on the CPU it needs a C++ compiler).
    """
    step = Step(model, progress, eager_otherwise, store.used(model.device) if stored is None else stored)
    try:
        if step.ahead_of_time is not None:
            try:
                if not eager_otherwise:
                    # No compiler is said now, not after the export and lowering that come before it (a minute or
                    # two of a core for the default model).
                    reason = None if step.ahead_of_time.stored(batch_size) else _no_compiler(kernels=False)
                    if reason is not None:
                        raise CompileFailed(reason)
                    step.ahead_of_time.runner(batch_size)  # loaded from its package, or built and stored first
                    return step
                reason = _no_compiler() if not step.ahead_of_time.stored(batch_size) else None
                if reason is not None:  # said now, not when a build on the background thread fails
                    raise CompileFailed(reason)
                if step.ahead_of_time.ready(batch_size) is None:  # built in the background; loaded now otherwise
                    _unfinished.append((step, progress))
                return step
            except Unsupported:
                step.ahead_of_time = None
        if eager_otherwise:
            return step
        # Under inference mode, as generate() runs: tensors made outside it would not match the guards.
        with torch.inference_mode():
            tokens = torch.zeros((1, 3), dtype=torch.long, device=model.device)
            # Sizes and positions of 0 or 1 would be compiled as constants, and a step that fills the cache
            # exactly as a special case; generate() never fills its cache (the last token is not fed).
            cache = model.new_kv_cache(1, 4)
            model(tokens[:, :2], 0, cache)
            step(tokens[:, 2:], 2, cache, num_logits=1)
    except Exception as e:  # Inductor's failures (no compiler, a bad toolchain) come as many exception types
        reason = first_line(e)
        hint = " (or try LLAMA_COMPILE_CPP_WRAPPER=0)" if step._cpp_wrapper and step.ahead_of_time is None else ""
        raise CompileFailed(reason, hint) from e
    return step


# Batch sizes at which the compiled step is built before serving: one graph each for 1 row, 2-4 rows and 5 or
# more (the compiled linear layers compute up to 4 rows as reductions, more with a matrix product), each with a
# block-table width unlike its batch size (two dimensions first seen at one size would share one symbol, and
# the first step where they differ would compile again: minutes on a CPU).
_WARM_UP = ((1, 3), (2, 3), (5, 4))


def compile_paged_step(model: Transformer, cache: PagedKVCache, step: str, strict: bool, max_rows: int = 16,
                       progress: Optional[Progress] = None) -> Tuple[Optional[Step], List[str]]:
    """llama-server's decode step (one token per row, rows at their own positions, `Step.paged`), compiled now as the
    run plan's `batched_step` says ("stored" or "torch.compile", llama/run_plan.py), and the notes the user should
    hear. Not `strict` (compile_layers="auto"), the step is None where it cannot be had, and a note says why;
    `strict`, it is compiled or this raises.

    Float weights are laid out row-major, as `Llama.build(compile=True)` does for its step; the layers keep the
    classes they were loaded with (`Llama.build(compile_layers=...)` plans them for this step). On the CPU the step
    comes from stored packages (llama/compile/aot.py), one for a single row and one for each range of batch sizes up
    to `max_rows`, each serving every table width and pool size; elsewhere from torch.compile (not with "auto"),
    with batch size and table width symbolic so that no step met while serving compiles anything again (tested).

    Raises:
        LlamaError: the step could not be compiled (on the CPU it needs a C++ compiler), and `strict`.
    """
    auto, notes = not strict, []
    for module in model.modules():
        if isinstance(module, nn.Linear) and not module.weight.is_contiguous():
            module.weight = nn.Parameter(module.weight.detach().contiguous(), requires_grad=False)
    compiled = Step(model, progress, eager_otherwise=auto, stored=step == "stored", pool=cache)
    if step == "stored":
        try:
            sizes = sorted({PagedStep.size_range(n) for n in range(1, max_rows + 1)})
            if auto:
                reason = _no_compiler()
            else:  # said before the export and lowering that come before the compiler, as compile_step does
                stored = all(compiled.ahead_of_time.stored(size) for size in sizes)
                reason = None if stored else _no_compiler(kernels=False)
            if reason is not None:
                raise RuntimeError(reason)
            for size in sizes:
                # The default serves at once: packages not stored yet are built in the background, and each runs
                # from the first step after it is ready. compile=True waits for them.
                compiled.ahead_of_time.ready(size) if auto else compiled.ahead_of_time.runner(size)
        except Unsupported as e:
            if not auto:
                raise LlamaError(f"compile=True failed: the server's step cannot be compiled ahead of time ({e})") from e
            return None, notes
        except Exception as e:  # Inductor's failures (no compiler, a bad toolchain) come as many exception types
            reason = first_line(e)
            if not auto:
                raise LlamaError(f"compile=True failed: the server's decode step could not be compiled ({reason}); "
                                 "run without compile=True") from e
            notes.append(eager_note(reason))
            return None, notes
        notes.extend(compiled.notes)
        return compiled, notes
    try:
        with torch.inference_mode():
            for bsz, width in _WARM_UP:  # block 0's first position is scratch until a sequence takes the block
                zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=model.device)  # noqa: E731
                # Three tensors: one would be guarded on.
                compiled.paged(zeros(bsz, 1), zeros(bsz, 1), zeros(bsz, width))
    except Exception as e:  # Inductor fails in many ways (no compiler, a bad toolchain)
        reason = first_line(e)
        raise LlamaError(f"compile=True failed: torch.compile could not build the server's step ({reason}); "
                         "run without compile=True") from e
    return compiled, notes
