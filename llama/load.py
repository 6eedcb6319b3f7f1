"""Loading a model as its `ModelFlags` ask: the facts gathered, the run planned once, the weights read as planned and
the decode step made.

`load` is `Llama.build`'s work (llama/generation.py): it gathers what the machine and the checkpoint say (`Facts`),
asks llama/run_plan.py's `plan_run` for the `RunPlan` (once more after loading the CPU kernels, where the plan uses
them and they were not loaded: what loading them found is a fact too), and carries the plan out.
"""

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import List, NamedTuple, Optional

import torch

from llama import kernels
from llama.compile import store
from llama.compile.step import CompileFailed, Step, compile_step, eager_note
from llama.convert.cache import resolve_checkpoint
from llama.io.checkpoint import CheckpointReader, find_tokenizer, model_args, read_params
from llama.io.weights import choose_dtype, load_weights, resolve_plan
from llama.model import Transformer
from llama.nn.parallel import parallelize
from llama.quant.dot_linears import DotLinear
from llama.quant.format import read_record
from llama.quant.layer import QuantizedLinear
from llama.quant.layer_plan import Kernels, LayerPlan
from llama.quant.quantize import check_method, plan_for, slow_path_note
from llama.run_plan import Facts, ModelFlags, RunPlan, plan_run
from llama.runtime.devices import local_device, resolve_device, resolve_dtype
from llama.runtime.distributed import init_distributed
from llama.runtime.progress import Progress
from llama.tokenizer import Tokenizer


@dataclass
class LoadInfo:
    """What `Llama.build` loaded, from where and how, and what it decided that the user should hear of."""

    ckpt_dir: Optional[Path] = None  # where the weights were read; None for a model built in memory
    quantization: Optional[str] = None  # how the linear layers are held: None (float), "int8", "int4-g32", ...
    rank: int = 0
    world_size: int = 1
    notes: List[str] = field(default_factory=list)
    load_seconds: float = 0.0
    compile_seconds: float = 0.0
    quant_kernels: Optional[str] = None  # what quantized layers multiply with: "integer" or "exact"; None: float
    layer_plan: Optional[LayerPlan] = None  # the class each layer was made (llama/quant/layer_plan.py)
    plan: Optional[RunPlan] = None  # how the run was planned (llama/run_plan.py)


def _make_step(model: Transformer, plan: RunPlan, progress: Optional[Progress], notes: List[str]) -> Optional[Step]:
    """The compiled step `plan` says, or None where compile="auto" finds none to be had (`notes` then says why)."""
    try:
        step = compile_step(model, progress, eager_otherwise=not plan.strict, batch_size=plan.compile_batch_size,
                            stored=plan.step == "stored")
    except CompileFailed as e:
        if plan.strict:
            raise
        notes.append(eager_note(e.reason))
        return None
    notes += step.notes
    return step if plan.strict or step.ahead_of_time is not None else None


class Loaded(NamedTuple):
    model: Transformer
    tokenizer: Tokenizer
    info: LoadInfo
    step: Optional[Step]  # the compiled decode step; None: the model's own, eager


def load(flags: ModelFlags, progress: Optional[Progress] = None) -> Loaded:
    """The model, tokenizer and compiled step `flags` ask for (`Llama.build`'s arguments say what each means).

    Raises:
        LlamaError: a flag out of its choices, a missing or malformed file, weights that do not fit the device or do
            not match params.json, or a plan that cannot run here.
    """
    flags = flags.checked()
    ckpt_dir = Path(resolve_checkpoint(flags.ckpt_dir, progress))
    device = local_device(resolve_device(flags.device))
    block_scales = device.type == "cpu" and flags.quant_kernels == "integer"  # what the memory check counts
    dtype = resolve_dtype(flags.dtype, device)
    rank, world_size = init_distributed(device, flags.model_parallel_size)
    params = read_params(ckpt_dir)
    tokenizer = Tokenizer(str(flags.tokenizer_path or find_tokenizer(ckpt_dir)))
    args = model_args(params, flags.max_seq_len, flags.max_batch_size, tokenizer.n_words,
                      source=str(ckpt_dir / "params.json"))

    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(args)
    if world_size > 1:
        model = parallelize(model, world_size)
    if flags.dtype is not None and read_record(ckpt_dir) is None:
        # Refuse a model that cannot fit before even opening its files.
        choose_dtype(None, args, plan_for(model, check_method(flags.quantize)) if flags.quantize else {}, dtype,
                     explicit=True, device=device, world_size=world_size, block_scales=block_scales)
    reader = CheckpointReader(ckpt_dir)  # memory-mapped: nothing read yet
    reader.check(args)
    quant = resolve_plan(model, reader, flags.quantize)
    # Refuse before reading gigabytes that cannot fit.
    dtype, dtype_notes = choose_dtype(reader, args, quant, dtype, flags.dtype is not None, device, world_size,
                                      block_scales)
    facts = Facts(device, world_size, store.used(device), quant, dtype, tuple(dtype_notes), Kernels.here(),
                  kernels.unavailable_reason(),
                  store.UNSUPPORTED_NOTE if device.type == "cpu" and not store.SUPPORTED else None)
    plan = plan_run(flags, facts)
    if plan.needs_kernels and not kernels.loaded():  # planned again with what loading them found
        kernels.load(progress)
        plan = plan_run(flags, replace(facts, kernels=Kernels.here(), kernels_missing=kernels.unavailable_reason()))
    model, layer_plan = load_weights(model, reader, args, plan.quant, rank, world_size, device, plan.dtype,
                                     compiled=plan.compiled_layers, integer=plan.integer, have=plan.kernels,
                                     progress=progress, row_exact_float=plan.row_exact_float)
    model.kv_cache_dtype = plan.kv_cache_dtype if plan.kv_cache_dtype != plan.dtype else None
    notes = list(plan.notes)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    on_exact_paths = [m for m in quantized if not isinstance(m, DotLinear)]
    if on_exact_paths and device.type == "cpu" and plan.dtype == torch.float32 and plan.step == "eager":
        notes.append(slow_path_note(plan.quant, world_size))
    running = None if not quantized else "exact" if on_exact_paths else "integer"
    info = LoadInfo(ckpt_dir, plan.quantization, rank, world_size, notes, quant_kernels=running,
                    layer_plan=layer_plan, plan=plan)
    step = None
    if plan.step != "eager":
        compile_start = time.perf_counter()
        step = _make_step(model, plan, progress, info.notes)
        info.compile_seconds = time.perf_counter() - compile_start
    info.load_seconds = time.perf_counter() - start
    return Loaded(model, tokenizer, info, step)
