"""What a run does, decided once: the user's `ModelFlags` and the machine's `Facts` in, a frozen `RunPlan` out.

Every "which path?" question a load asks (the dtype, the KV cache's dtype, the integer kernels or the exact paths,
layers planned for a compiled step or an eager one, a stored step or torch.compile, and what the user is told) is
answered by `plan_run`, a function of its two arguments alone; `Llama.build` gathers the facts, asks it, and carries
the plan out. Nothing downstream asks again: `describe` prints it (`--stats`, the server's start line).
"""

from dataclasses import dataclass, field, replace
from typing import Optional, Tuple, Union

import torch

from llama.compile.step import default_compile, kv_cache_dtype_note
from llama.errors import LlamaError
from llama.kv_cache import resolve_kv_cache_dtype
from llama.quant.format import Plan, is_linear_weight
from llama.quant.layer_plan import Kernels, row_exact_floats
from llama.quant.quantize import check_method, check_quant_kernels, describe_plan

Compile = Union[bool, str]  # True, False or "auto"
STEPS = ("eager", "stored", "torch.compile")  # how the decode step with the cache runs


@dataclass(frozen=True)
class ModelFlags:
    """How to load and run a model, as the user says it: `Llama.build`'s keyword arguments and every command's model
    flags (llama/cli/flags.py has their help). None means "the default", resolved by `checked` and the plan."""

    ckpt_dir: Optional[str] = None  # a checkpoint in Meta's layout, a .gguf file or a Hugging Face folder
    tokenizer_path: Optional[str] = None  # None: the one in (or beside) the checkpoint directory
    max_seq_len: int = 2048
    max_batch_size: int = 8
    model_parallel_size: Optional[int] = None  # None: the processes torchrun started
    seed: int = 1
    device: Optional[Union[str, torch.device]] = None  # None: $LLAMA_DEVICE, else CUDA when present, else the CPU
    dtype: Optional[Union[str, torch.dtype]] = None  # None: bf16 on CUDA, float32 elsewhere
    compile: Optional[Compile] = None  # None: $LLAMA_COMPILE, else "auto"
    quantize: Optional[str] = None  # "int8" or "int4" as the weights load
    quant_kernels: str = "integer"  # or "exact"
    kv_cache_dtype: Optional[Union[str, torch.dtype]] = None  # None or "auto": the model's dtype
    compile_batch_size: int = 1  # the batch size whose stored step is ready when the load returns
    compile_layers: Optional[Compile] = None  # the layers planned for a step the caller compiles (llama-server's)

    def checked(self) -> "ModelFlags":
        """These flags with `compile` resolved, after every check that needs no machine and no checkpoint.

        Raises:
            LlamaError: a value that is not one of its choices, in one line.
        """
        check_quant_kernels(self.quant_kernels)
        check_method(self.quantize)
        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32)
        compile = default_compile() if self.compile is None else self.compile
        if compile not in (True, False, "auto"):
            raise LlamaError(f"compile must be True, False or \"auto\", not {compile!r}")
        return replace(self, compile=compile)


@dataclass(frozen=True)
class Facts:
    """What the machine and the checkpoint say, gathered before anything is decided."""

    device: torch.device  # this process's device
    world_size: int  # processes the model is split across
    stored_step: bool  # a compiled step on `device` comes from stored packages (llama/compile/store.py `used`)
    quant: Plan  # weight name -> (method, group size): what the linear layers hold (llama/io/weights.py resolve_plan)
    dtype: torch.dtype  # what the weights compute in, checked to fit in memory (llama/io/weights.py choose_dtype)
    dtype_notes: Tuple[str, ...] = ()  # why `dtype` is not the one asked for
    kernels: Kernels = Kernels()  # the kernels the process has loaded
    kernels_missing: Optional[str] = None  # why llama/kernels cannot run here; None where they can or were not tried
    stored_step_note: Optional[str] = None  # why no stored step can run here (an old torch); None where one can


@dataclass(frozen=True)
class RunPlan:
    """How a model runs, decided once from its flags and the facts (`plan_run`)."""

    device: torch.device
    world_size: int
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype  # what the KV cache holds keys and values in
    quant: Plan = field(default_factory=dict)  # what the linear layers hold quantized
    integer: bool = False  # quantized layers on the integer kernels (llama/quant/dot_linears.py)
    row_exact_float: bool = False  # float32 products, attention, rotary and norms row-exact (for an int8 cache)
    compiled_layers: bool = False  # layers planned for a compiled decode step (llama/quant/layer_plan.py)
    step: str = "eager"  # one of STEPS: how the decode step with the cache runs
    strict: bool = False  # compile=True: every step compiled (by torch.compile where no package serves), a failure
    # an error; otherwise ("auto") the steps no stored package serves run eagerly, a failure a note
    batched_step: str = "eager"  # one of STEPS: llama-server's step of many rows over a paged cache (compile_layers)
    batched_strict: bool = False  # compile_layers=True: that step compiled, a failure an error; "auto": a note
    compile_batch_size: int = 1
    kernels: Kernels = Kernels()  # the kernels the layer plan may choose
    needs_kernels: bool = False  # the plan would use llama/kernels: loaded before the weights are
    adapt_threads: bool = False  # decode steps' threads follow the cores they get (llama/runtime/threads.py): every
    # product, attention and norm of the step is one of llama/kernels', whose rows do not depend on the thread count
    notes: Tuple[str, ...] = ()  # what the user should hear of

    @property
    def quantization(self) -> Optional[str]:
        """How the linear layers are held: None (float), "int8", "int4-g32", ..."""
        return describe_plan(self.quant)

    def describe(self) -> str:
        """The plan in a line: "cpu, float32 (int8 cache), int8 on the integer kernels, stored decode step"."""
        parts = [str(self.device), str(self.dtype).removeprefix("torch.")]
        if self.kv_cache_dtype != self.dtype:
            parts[-1] += f" ({str(self.kv_cache_dtype).removeprefix('torch.')} KV cache)"
        if self.quant:
            parts.append(f"{self.quantization} on the {'integer kernels' if self.integer else 'exact paths'}")
        parts.append({"eager": "eager decode step", "stored": "stored compiled decode step",
                      "torch.compile": "decode step compiled by torch.compile"}[self.step])
        if self.batched_step != "eager":
            parts.append({"stored": "stored compiled batched step",
                          "torch.compile": "batched step compiled by torch.compile"}[self.batched_step])
        if self.world_size > 1:
            parts.append(f"split across {self.world_size} processes")
        return ", ".join(parts)


def check_one_process(world_size: int) -> None:
    """compile=True's refusal under torchrun: a compiled step runs in one process (the default's too, where it
    compiles nothing)."""
    if world_size > 1:
        raise LlamaError(f"compile=True runs in one process, not under torchrun with {world_size} processes")


def check_before_loading(flags: ModelFlags, world_size: int, stored_step: bool) -> None:
    """`plan_run`'s refusals that need no checkpoint, for a command that refuses before it loads (llama-server, which
    listens while it loads): compile=True (or compile_layers=True) under torchrun, or over an int8 KV cache where no
    stored step serves (`stored_step`: llama/compile/store.py `used` on the flags' device).

    Raises:
        LlamaError: the refusal, as `plan_run` words it.
    """
    flags = flags.checked()
    if flags.compile is not True and flags.compile_layers is not True:
        return
    check_one_process(world_size)
    if resolve_kv_cache_dtype(flags.kv_cache_dtype, torch.float32) == torch.int8:  # never the model's dtype
        kv_cache_dtype_note(torch.int8, explicit=True, stored_step=stored_step)


def plan_run(flags: ModelFlags, facts: Facts) -> RunPlan:
    """The run `flags` ask for on the machine and checkpoint `facts` describe (flags `checked` first).

    `flags.compile_layers` (llama-server's) plans the layers for the server's batched step instead of the command's
    step, and `batched_step` says how that step runs: "auto" from stored packages where they can be had, eagerly
    elsewhere; True from stored packages on the CPU and by torch.compile elsewhere; always eagerly under torchrun.

    Raises:
        LlamaError: the flags ask for what cannot run here (compile=True or compile_layers=True under torchrun, or
            either over a KV cache in another dtype where only torch.compile could compile it).
    """
    cpu = facts.device.type == "cpu"
    notes = list(facts.dtype_notes)
    auto = flags.compile == "auto"
    compile = cpu and facts.world_size == 1 if auto else bool(flags.compile)
    if compile:
        check_one_process(facts.world_size)
    if flags.compile_layers is None:
        compiled_layers = compile
    else:  # llama-server's step, which "auto" compiles only from stored packages
        if flags.compile_layers is True:
            check_one_process(facts.world_size)
        compiled_layers = facts.world_size == 1 and (
            flags.compile_layers is True or (flags.compile_layers == "auto" and facts.stored_step))
        if flags.compile_layers == "auto" and facts.world_size == 1 and facts.stored_step_note is not None:
            notes.append(facts.stored_step_note)
    kv_dtype = resolve_kv_cache_dtype(flags.kv_cache_dtype, facts.dtype)
    if kv_dtype != facts.dtype and compiled_layers and not facts.stored_step:
        notes.append(kv_cache_dtype_note(kv_dtype, explicit=(compile and not auto) or flags.compile_layers is True,
                                         stored_step=False))
        compile = compiled_layers = False
    quantized = any(map(is_linear_weight, facts.quant))
    integer = quantized and cpu and flags.quant_kernels == "integer"
    float32 = cpu and facts.dtype == torch.float32
    needs_kernels = integer or (float32 and (compiled_layers or kv_dtype == torch.int8))
    if integer and facts.kernels_missing is not None:
        notes.append(f"the int8/int4 integer kernels cannot run here: {facts.kernels_missing}; quantized layers run "
                     "on the exact weight-only paths")
        integer = False
    # Keys and values rounded to int8: every float32 product row-exact too, so that the cached and uncached passes,
    # which compute a key among different rows, round it alike (llama/quant/linears.py, RowExactLinear).
    row_exact_float = row_exact_floats(kv_dtype == torch.int8, facts.dtype, cpu, facts.kernels)
    adapt_threads = (float32 and facts.world_size == 1 and facts.kernels.llama_kv
                     and (compiled_layers or row_exact_float))
    batched_step = "eager"
    if flags.compile_layers is not None and compiled_layers:
        batched_step = "stored" if facts.stored_step else "torch.compile"
    if not compile:
        step = "eager"
    elif facts.stored_step:
        step = "stored"
    else:
        step = "eager" if auto else "torch.compile"
        if auto and facts.stored_step_note is not None:
            notes.append(facts.stored_step_note)
    return RunPlan(facts.device, facts.world_size, facts.dtype, kv_dtype, dict(facts.quant), integer, row_exact_float,
                   compiled_layers, step, strict=compile and not auto, batched_step=batched_step,
                   batched_strict=flags.compile_layers is True,
                   compile_batch_size=flags.compile_batch_size, kernels=facts.kernels, needs_kernels=needs_kernels,
                   adapt_threads=adapt_threads, notes=tuple(notes))

