"""Filling a model built on the meta device from a checkpoint, one tensor at a time.

Each tensor is read from the memory-mapped file, converted to what the model holds (its dtype and device,
quantized, or laid out input-major), assigned, and its pages of the file are handed back to the kernel
before the next one is read. The peak is therefore the model as it will run plus one tensor in flight,
never the whole checkpoint twice (docs/benchmarks.md has a 7B load's peak, before and after).

Pages of a memory-mapped file count as resident once touched. A tensor that is used as it lies in the file
(same dtype, same layout) keeps its pages; one that is converted has them released with
madvise(MADV_DONTNEED), which is safe because they are clean, private, file-backed pages: touching them
again would read them back from the file.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from llama.io.checkpoint import CheckpointReader, expected_shapes
from llama.runtime.devices import available_memory
from llama.errors import LlamaError
from llama.model import ModelArgs
from llama.runtime.pages import huge_empty, release_pages, return_free_memory, shared_huge_pages
from llama.runtime.progress import Progress, or_silent
from llama.quant.embedding import swap_embedding
from llama.quant.format import DEFAULT_INT4_GROUP_SIZE, EMBEDDING_WEIGHT, Plan, is_linear_weight, quantized_shapes
from llama.quant.layer_plan import Kernels, LayerPlan, apply_layer_plan, describe_layers, row_exact_floats, plan_layers
from llama.quant.quantize import check_method, describe_plan, layer_method, plan_for, quantize_weight, swap_linears
from llama.nn.sharding import split_dim

# Scratch for quantizing one weight (llama/quant/quantize.py works 2**22 elements at a time, float32, a few copies).
_QUANTIZE_SCRATCH = 8 * 4 * (1 << 22)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_plan(model: nn.Module, source: CheckpointReader, quantize: Optional[str]) -> Plan:
    """What each linear layer will hold: the checkpoint's own quantization, or the one asked for; and the
    embedding, quantized where the checkpoint stores it so (whatever `quantize` says: it is never rounded again).

    Raises:
        LlamaError: `quantize` asks for something other than what a quantized checkpoint holds.
    """
    quantize = check_method(quantize)
    plan = dict(source.stored_plan)
    embedding = plan.pop(EMBEDDING_WEIGHT, None)
    if plan:
        stored = {name: m for name, (m, _) in plan.items()}
        if quantize is not None and any(m not in (quantize, layer_method(name, quantize)) for name, m in stored.items()):
            raise LlamaError(f"{source.ckpt_dir} is stored quantized as {describe_plan(source.stored_plan)}; "
                             f"quantize={quantize} would round its weights a second time: leave quantize= out "
                             "to run it as stored, or quantize the float checkpoint")
    elif quantize is not None:
        plan = plan_for(model, quantize)
    if embedding is not None:
        plan[EMBEDDING_WEIGHT] = embedding
    return plan


def _quantized_shapes(full_shapes: Dict[str, torch.Size], plan: Plan) -> Dict[str, torch.Size]:
    """quant_format.quantized_shapes, with per-channel int8 (group size None) as one group of the whole row."""
    return quantized_shapes(full_shapes, {n: (m, g or full_shapes[n][1]) for n, (m, g) in plan.items()})


def model_bytes(full_shapes: Dict[str, torch.Size], plan: Plan, dtype: torch.dtype, world_size: int,
                block_scales: bool = False) -> int:
    """Bytes this rank will hold once loaded: quantized tensors at their size, the rest in `dtype`.

    `block_scales`: the layers will run on the integer kernels, which hold per-channel int8's scale once per
    block of 32 columns (a sixteenth of the int8 bytes more).
    """
    shapes = _quantized_shapes(full_shapes, plan)
    if block_scales:
        for name, (method, group) in plan.items():
            out_features, in_features = full_shapes[name]
            if method == "int8" and group is None and in_features % 32 == 0 and is_linear_weight(name):
                shapes[name.removesuffix(".weight") + ".scales"] = torch.Size((out_features, in_features // 32))
    total = 0
    for name, shape in shapes.items():
        itemsize = dtype.itemsize
        if name in plan:
            itemsize = 1
        elif name.endswith((".scales", ".mins")):
            itemsize = 2
        total += shape.numel() * itemsize // (world_size if split_dim(name) is not None else 1)
    return total


def peak_bytes(full_shapes: Dict[str, torch.Size], plan: Plan, dtype: torch.dtype, world_size: int,
               n_shards: int, stored_itemsize: int, block_scales: bool = False) -> int:
    """The most memory loading takes at once: the model plus the largest tensor in flight."""
    largest = max(s.numel() for s in full_shapes.values())
    in_flight = largest * max(dtype.itemsize, stored_itemsize)
    if n_shards not in (1, world_size):
        in_flight += largest * stored_itemsize  # shards joined before this rank's slice is taken
    if plan:
        in_flight = max(in_flight, _QUANTIZE_SCRATCH + largest * stored_itemsize)
    model = model_bytes(full_shapes, plan, dtype, world_size, block_scales)
    # Allocator slack and re-packing: the measured peaks of 7B and 13B loads ran past the two terms above by
    # less than this (docs/benchmarks.md, "Figures behind the code").
    return model + in_flight + model // 16 + 256 * 2**20


def choose_dtype(source: Optional[CheckpointReader], args: ModelArgs, plan: Plan, dtype: torch.dtype, explicit: bool,
                 device: torch.device, world_size: int, block_scales: bool = False) -> Tuple[torch.dtype, List[str]]:
    """The dtype to load in, checked to fit in memory with everything loading takes; and notes for the user.

    A bf16 checkpoint whose float32 copy would not fit runs in bf16 on the CPU when no dtype was asked for.
    `source` None checks `dtype` alone, before any weight file is opened. `block_scales` is `model_bytes`'s.

    Raises:
        LlamaError: even the chosen way would not fit (in one line, with what would).
    """
    full = expected_shapes(args)
    stored_dtype = source.float_dtype if source is not None else None
    stored_itemsize = (stored_dtype or dtype).itemsize
    n_shards = len(source.shards) if source is not None else 1
    free = available_memory(device)

    def need(d: torch.dtype) -> int:
        return peak_bytes(full, plan, d, world_size, n_shards, stored_itemsize, block_scales)

    if free is None or need(dtype) <= free:
        return dtype, []
    gib = 2 ** 30
    if (not explicit and device.type == "cpu" and dtype == torch.float32 and stored_dtype == torch.bfloat16
            and need(torch.bfloat16) <= free):
        note = (f"the checkpoint is stored in bfloat16 and a float32 copy ({need(dtype) / gib:.1f} GiB) would not fit "
                f"in the {free / gib:.1f} GiB available, so it runs in bfloat16 (dtype= chooses)")
        return torch.bfloat16, [note]
    kind = describe_plan(plan)
    held = f"{kind} with the rest in " if kind else ""
    # Say which of the smaller ways would fit, with what each needs, rather than a list of guesses.
    options = []
    if dtype == torch.float32 and need(torch.bfloat16) <= free:
        options.append(f"dtype=bfloat16 ({need(torch.bfloat16) / gib:.1f} GiB)")
    if not source or not source.stored_plan:  # a stored quantized checkpoint loads only as it is
        for method in ("int8", "int4"):
            alternative = {n: (method, None if method == "int8" else DEFAULT_INT4_GROUP_SIZE)
                           for n in full if is_linear_weight(n)}
            cost = peak_bytes(full, alternative, torch.bfloat16, world_size, n_shards, stored_itemsize, block_scales)
            if cost < need(torch.bfloat16) and cost <= free:
                options.append(f"quantize={method} dtype=bfloat16 ({cost / gib:.1f} GiB)")
    hint = ("; these would fit: " + ", ".join(options)) if options else \
        "; nothing smaller fits on one device here: use more model-parallel processes or another device"
    raise LlamaError(f"the model's weights in {held}{str(dtype).removeprefix('torch.')} needs {need(dtype) / gib:.1f} GiB "
                     f"on {device} but only {free / gib:.1f} GiB is available{hint}")


def load_weights(model: nn.Module, source: CheckpointReader, args: ModelArgs, plan: Plan, rank: int, world_size: int,
                 device: torch.device, dtype: torch.dtype, compiled: bool, integer: bool = True,
                 have: Optional[Kernels] = None, progress: Optional[Progress] = None,
                 row_exact_float: bool = False) -> Tuple[nn.Module, LayerPlan]:
    """Fill `model` (built on the meta device, already split for `world_size` ranks) from `source`, and make each
    layer the class its layer plan says (llama/quant/layer_plan.py); returns the model and the plan.

    Args:
        plan: weight name -> (method, group size) for the linear layers to hold quantized (from the file, or
            to quantize as they load), and for the embedding where the file holds it quantized
            (llama/quant/embedding.py: its rows dequantized as tokens look them up).
        compiled: lay the weights out for llama/compile/step.py's step rather than for eager runs. Eager CPU runs
            hold float projections with more outputs than inputs input-major (MKL's one-row product reads a wide
            matrix about twice as fast so); compiled ones keep them row-major for their reductions.
            The layers are planned for the step it says.
        integer: quantized layers run on the integer kernels where they apply (llama/quant/dot_linears.py), rather
            than on the exact weight-only paths.
        have: the kernels the plan may choose (None: what the process has loaded, `Kernels.here()`).
        progress: told ("loading weights", tensors done, tensors in all) as it goes.
        row_exact_float: float32 layers row-exact too (`plan_layers`), their weights row-major.
    """
    have = have or Kernels.here()
    row_exact_float = row_exact_floats(row_exact_float, dtype, device.type == "cpu", have)
    input_major = device.type == "cpu" and not compiled and not row_exact_float
    progress = or_silent(progress)
    full_shapes = expected_shapes(args)
    stored = _quantized_shapes(full_shapes, source.stored_plan)
    if world_size > 1:
        for name, shape in stored.items():
            dim = split_dim(name)
            if dim is not None and shape[dim] % world_size:
                raise LlamaError(f"{source.ckpt_dir}: {name} has {shape[dim]} columns of groups, which do not "
                                 f"split across {world_size} processes; run it in one process")
    swap_linears(model, {k: v for k, v in plan.items() if k != EMBEDDING_WEIGHT})
    if EMBEDDING_WEIGHT in plan:  # only where the checkpoint stores it quantized: loading never quantizes it
        swap_embedding(model, *plan[EMBEDDING_WEIGHT], dtype)
    layers = dict(model.named_modules())
    total, state = len(source.shards[0]), {}
    progress("loading weights", 0, total)
    with shared_huge_pages():  # float weights under 2 MiB side by side on 2 MiB pages (`_weight_buffer`)
        for i, (name, local, pieces) in enumerate(source.tensors(rank, world_size)):
            if name in plan and name not in source.stored_plan:
                layer = layers[name.removesuffix(".weight")]
                for suffix, tensor in quantize_weight(local, *plan[name][:1], layer.group_size).items():
                    state[f"{name.removesuffix('.weight')}.{suffix}"] = tensor.to(device)
            elif local.dtype in _FLOAT_DTYPES and not name.endswith((".scales", ".mins")):
                if input_major and is_linear_weight(name) and local.shape[0] >= local.shape[1]:
                    # Input-major in one copy (converting first, then transposing, would allocate twice). Copying
                    # into the contiguous buffer from the transposed source, rather than into its transposed view
                    # from the source, lets torch use its cache-blocked transpose: half the load time here.
                    buffer = _weight_buffer(local.shape[::-1], dtype, device)
                    buffer.copy_(local.t())
                    tensor = buffer.t()
                elif is_linear_weight(name):
                    tensor = _weight_buffer(local.shape, dtype, device).copy_(local)
                else:
                    tensor = local.to(device=device, dtype=dtype)
                state[name] = tensor
            else:
                # Stored int8 / uint8 values and their float16 scales stay as they are (in bf16 they would be rounded).
                # A rank's slice of columns is a strided view of the file's tensor: copied into rows of its own, as
                # torch's int8 kernel needs them (a slice of one group is per-channel int8), and the file's pages freed.
                state[name] = local.to(device).contiguous()
            kept = state.get(name)
            for piece in pieces:
                if kept is None or not _shares_memory(kept, piece):
                    release_pages(piece)
            del local, pieces
            # Freed scratch (quantizing's float32 rows, a converted tensor's old copy) stays in glibc's heap
            # unless handed back; without this the heap grew by more than the model from tensor to tensor.
            return_free_memory()
            progress("loading weights", i + 1, total)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # names or shapes that disagree with the model: a damaged checkpoint
        raise LlamaError(f"{source.ckpt_dir} does not fit the model params.json describes ({str(e).splitlines()[0]})") from None
    model.requires_grad_(False).eval()
    # Re-packing replaces a stored weight; holding the old ones here would keep the model twice.
    stored = [(n.removesuffix(".weight"), state[n]) for n in source.stored_plan]
    state.clear()
    layers = None  # nor the old layers, which apply_layer_plan frees one parent at a time
    specs, groups = describe_layers(model)
    layer_plan = plan_layers(specs, model.dtype, model.device.type, compiled, have, integer, groups,
                             row_exact_float=row_exact_float)
    apply_layer_plan(model, layer_plan)
    layers = dict(model.named_modules())
    for name, tensor in stored:
        layer = layers.get(name)  # None: made one product with others (llama/quant/fuse.py), in memory of its own
        if layer is None or not any(_shares_memory(tensor, held) for held in layer.buffers()):
            release_pages(tensor)  # re-packed: the file's copy of these bytes is no longer read
    return_free_memory()
    return model, layer_plan


def _weight_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a float linear weight is held: on the CPU in memory that asked for 2 MiB pages, as the integer layers'
    are (llama/runtime/pages.py), since a decode step streams every weight once and reads a layer of megabytes
    faster from them than from 4 KiB pages (the file's mapped pages, or glibc's heap); elsewhere torch.empty."""
    if device.type == "cpu":
        return huge_empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
