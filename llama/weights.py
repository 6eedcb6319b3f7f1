"""Filling a model built on the meta device from a checkpoint, one tensor at a time.

Each tensor is read from the memory-mapped file, converted to what the model holds (its dtype and device,
quantized, or laid out input-major), assigned, and its pages of the file are handed back to the kernel
before the next one is read. The peak is therefore the model as it will run plus one tensor in flight,
never the whole checkpoint twice: 13.5 GB of bf16 7B weights no longer need 23.7 GB to load.

Pages of a memory-mapped file count as resident once touched. A tensor that is used as it lies in the file
(same dtype, same layout) keeps its pages; one that is converted has them released with
madvise(MADV_DONTNEED), which is safe because they are clean, private, file-backed pages: touching them
again would read them back from the file.
"""

import ctypes
import mmap
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from llama.checkpoint import IGNORED_KEYS, expected_shapes, load_shard, shard_paths
from llama.distributed import available_memory
from llama.errors import LlamaError
from llama.model import ModelArgs
from llama.progress import Progress, or_silent
from llama.quant_format import DEFAULT_INT4_GROUP_SIZE, RECORD_NAME, is_linear_weight, method_of, quantized_shapes, read_record
from llama.quantize import (
    Plan, check_method, describe, plan_for, quantize_weight, swap_linears, use_cpu_kernel_layout,
    use_reduction_layout,
)
from llama.sharding import split_dim

# Scratch for quantizing one weight (llama/quantize.py works 2**22 elements at a time, float32, a few copies).
_QUANTIZE_SCRATCH = 8 * 4 * (1 << 22)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Source:
    """A checkpoint's weight files, opened (memory-mapped), with what they hold."""

    ckpt_dir: Path
    paths: List[Path]
    shards: List[Dict[str, torch.Tensor]]
    record: Optional[Dict]
    stored_plan: Plan = field(default_factory=dict)  # weights the files hold quantized

    @property
    def float_dtype(self) -> Optional[torch.dtype]:
        """The dtype of the checkpoint's float tensors (the first one found)."""
        for tensor in self.shards[0].values():
            if tensor.dtype in _FLOAT_DTYPES:
                return tensor.dtype
        return None


def open_checkpoint(ckpt_dir: Path, args: ModelArgs) -> Source:
    """Memory-map a checkpoint's shards and learn which weights are stored quantized (nothing is read yet)."""
    paths = shard_paths(ckpt_dir)
    shards = []
    for path in paths:
        shard = load_shard(path)
        for key in IGNORED_KEYS:
            shard.pop(key, None)
        shards.append(shard)
    for path, shard in zip(paths[1:], shards[1:]):
        if set(shard) != set(shards[0]):
            raise LlamaError(f"{path} does not hold the same tensor names as {paths[0]}")
    record = read_record(ckpt_dir)
    source = Source(Path(ckpt_dir), paths, shards, record)
    full = expected_shapes(args)
    first = shards[0]
    for name, shape in full.items():
        method = method_of(first, name) if is_linear_weight(name) else None
        if method is None:
            continue
        scales = first[name.removesuffix(".weight") + ".scales"]
        dim = split_dim(name)
        n_groups = scales.shape[1] * (len(shards) if dim == 1 else 1)
        if scales.ndim != 2 or n_groups == 0 or shape[1] % n_groups:
            raise LlamaError(f"{ckpt_dir}: {name}'s scales have shape {tuple(scales.shape)}, which does not group "
                             f"its {shape[1]} input columns")
        per_channel = method == "int8" and n_groups == 1
        group_size = shape[1] // n_groups
        if method == "int4" and group_size % 2:
            raise LlamaError(f"{ckpt_dir}: {name} is int4 in groups of {group_size} columns; int4 packs columns in "
                             "pairs within each group, so the checkpoint is damaged")
        source.stored_plan[name] = (method, None if per_channel else group_size)
    if source.stored_plan and record is None:
        raise LlamaError(f"{ckpt_dir} holds quantized weights but no {RECORD_NAME}; the checkpoint is incomplete")
    if record is not None and not source.stored_plan:
        raise LlamaError(f"{ckpt_dir} has {RECORD_NAME} but its weights are not quantized; the checkpoint is damaged")
    return source


def _shape_check(source: Source, full_shapes: Dict[str, torch.Size]) -> None:
    """Every tensor present, none unexpected, each of the shape params.json (and the quantization) implies."""
    first = source.shards[0]
    missing = [k for k in full_shapes if k not in first]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise LlamaError(f"{source.ckpt_dir} is missing tensor {missing[0]}{more}")
    unexpected = [k for k in first if k not in full_shapes]
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise LlamaError(f"{source.ckpt_dir} has unexpected tensor {unexpected[0]}{more}")
    n = len(source.shards)
    for name, shape in full_shapes.items():
        dim = split_dim(name)
        pieces = [s[name].shape for s in source.shards]
        if dim is None or n == 1:
            merged = pieces[0]
            ok = all(p == merged for p in pieces)
        else:
            merged = list(pieces[0])
            merged[dim] = sum(p[dim] for p in pieces)
            ok = all(len(p) == len(shape) and all(p[d] == pieces[0][d] for d in range(len(p)) if d != dim) for p in pieces)
            merged = torch.Size(merged)
        if not ok or merged != shape:
            where = source.paths[0] if n == 1 else source.ckpt_dir
            got = tuple(pieces[0]) if n == 1 else f"{tuple(merged)} (joined from {n} shards)"
            raise LlamaError(f"{where}: tensor {name} has shape {got}, params.json implies {tuple(shape)}")


def _local_tensors(source: Source, rank: int, world_size: int) -> Iterator[Tuple[str, torch.Tensor, List[torch.Tensor]]]:
    """(name, this rank's slice, the file tensors it came from) for every tensor, in file order."""
    n = len(source.shards)
    for name in list(source.shards[0]):
        pieces = [shard[name] for shard in source.shards]
        dim = split_dim(name)
        if n == world_size:
            local = pieces[rank]
        else:
            whole = pieces[0] if dim is None or n == 1 else torch.cat(pieces, dim=dim)
            local = whole if dim is None or world_size == 1 else torch.chunk(whole, world_size, dim=dim)[rank]
        yield name, local, pieces


def resolve_plan(model: nn.Module, source: Source, quantize: Optional[str]) -> Plan:
    """What each linear layer will hold: the checkpoint's own quantization, or the one asked for.

    Raises:
        LlamaError: --quantize asks for something other than what a quantized checkpoint holds.
    """
    quantize = check_method(quantize)
    if source.stored_plan:
        stored = {m for m, _ in source.stored_plan.values()}
        if quantize is not None and stored != {quantize}:
            raise LlamaError(f"{source.ckpt_dir} is stored quantized as {describe(source.stored_plan)}; "
                             f"--quantize {quantize} would round its weights a second time: leave --quantize out "
                             "to run it as stored, or quantize the float checkpoint")
        return dict(source.stored_plan)
    return plan_for(model, quantize) if quantize is not None else {}


def _quantized_shapes(full_shapes: Dict[str, torch.Size], plan: Plan) -> Dict[str, torch.Size]:
    """quant_format.quantized_shapes, with per-channel int8 (group size None) as one group of the whole row."""
    return quantized_shapes(full_shapes, {n: (m, g or full_shapes[n][1]) for n, (m, g) in plan.items()})


def model_bytes(full_shapes: Dict[str, torch.Size], plan: Plan, dtype: torch.dtype, world_size: int) -> int:
    """Bytes this rank will hold once loaded: quantized tensors at their size, the rest in `dtype`."""
    shapes = _quantized_shapes(full_shapes, plan)
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
               n_shards: int, stored_itemsize: int) -> int:
    """The most memory loading takes at once: the model plus the largest tensor in flight."""
    largest = max(s.numel() for s in full_shapes.values())
    in_flight = largest * max(dtype.itemsize, stored_itemsize)
    if n_shards not in (1, world_size):
        in_flight += largest * stored_itemsize  # shards joined before this rank's slice is taken
    if plan:
        in_flight = max(in_flight, _QUANTIZE_SCRATCH + largest * stored_itemsize)
    model = model_bytes(full_shapes, plan, dtype, world_size)
    # Allocator slack and re-packing: measured peaks of 7B and 13B loads ran up to 0.5 GiB (6% of the model)
    # past the two terms above (docs/benchmarks.md).
    return model + in_flight + model // 16 + 256 * 2**20


def choose_dtype(source: Optional[Source], args: ModelArgs, plan: Plan, dtype: torch.dtype, explicit: bool,
                 device: torch.device, world_size: int) -> Tuple[torch.dtype, List[str]]:
    """The dtype to load in, checked to fit in memory with everything loading takes; and notes for the user.

    A bf16 checkpoint whose float32 copy would not fit runs in bf16 on the CPU when no dtype was asked for.
    `source` None checks `dtype` alone, before any weight file is opened.

    Raises:
        LlamaError: even the chosen way would not fit (in one line, with what would).
    """
    full = expected_shapes(args)
    stored_dtype = source.float_dtype if source is not None else None
    stored_itemsize = (stored_dtype or dtype).itemsize
    n_shards = len(source.shards) if source is not None else 1
    free = available_memory(device)

    def need(d: torch.dtype) -> int:
        return peak_bytes(full, plan, d, world_size, n_shards, stored_itemsize)

    if free is None or need(dtype) <= free:
        return dtype, []
    gib = 2 ** 30
    if (not explicit and device.type == "cpu" and dtype == torch.float32 and stored_dtype == torch.bfloat16
            and need(torch.bfloat16) <= free):
        note = (f"the checkpoint is stored in bfloat16 and a float32 copy ({need(dtype) / gib:.1f} GiB) would not fit "
                f"in the {free / gib:.1f} GiB available, so it runs in bfloat16 (--dtype chooses)")
        return torch.bfloat16, [note]
    kind = describe(plan)
    held = f"{kind} with the rest in " if kind else ""
    # Say which of the smaller ways would fit, with what each needs, rather than a list of guesses.
    options = []
    if dtype == torch.float32 and need(torch.bfloat16) <= free:
        options.append(f"--dtype bfloat16 ({need(torch.bfloat16) / gib:.1f} GiB)")
    if not source or not source.stored_plan:  # a stored quantized checkpoint loads only as it is
        for method in ("int8", "int4"):
            alternative = {n: (method, None if method == "int8" else DEFAULT_INT4_GROUP_SIZE)
                           for n in full if is_linear_weight(n)}
            cost = peak_bytes(full, alternative, torch.bfloat16, world_size, n_shards, stored_itemsize)
            if cost < need(torch.bfloat16) and cost <= free:
                options.append(f"--quantize {method} --dtype bfloat16 ({cost / gib:.1f} GiB)")
    hint = ("; these would fit: " + ", ".join(options)) if options else \
        "; nothing smaller fits on one device here: use more model-parallel processes or another device"
    raise LlamaError(f"the model's weights in {held}{str(dtype).removeprefix('torch.')} needs {need(dtype) / gib:.1f} GiB "
                     f"on {device} but only {free / gib:.1f} GiB is available{hint}")


def load_weights(model: nn.Module, source: Source, args: ModelArgs, plan: Plan, rank: int, world_size: int,
                 device: torch.device, dtype: torch.dtype, compiled: bool,
                 progress: Optional[Progress] = None) -> nn.Module:
    """Fill `model` (built on the meta device, already split for `world_size` ranks) from `source`.

    Args:
        plan: weight name -> (method, group size) for the linear layers to hold quantized (from the file, or
            to quantize as they load).
        compiled: lay the weights out for llama/compile.py's step rather than for eager runs. Eager CPU runs
            hold float projections with more outputs than inputs input-major (see
            Transformer.use_column_major_weights); compiled ones keep them row-major for their reductions,
            and hold int4 layers in the layout those read. In bf16 on the CPU, int4 layers take the CPU
            kernel's layout either way.
        progress: told ("loading weights", tensors done, tensors in all) as it goes.
    """
    input_major = device.type == "cpu" and not compiled
    progress = or_silent(progress)
    full_shapes = expected_shapes(args)
    stored = _quantized_shapes(full_shapes, source.stored_plan)
    _shape_check(source, stored)
    if world_size > 1:
        for name, shape in stored.items():
            dim = split_dim(name)
            if dim is not None and shape[dim] % world_size:
                raise LlamaError(f"{source.ckpt_dir}: {name} has {shape[dim]} columns of groups, which do not "
                                 f"split across {world_size} processes; run it in one process")
    swap_linears(model, {k: v for k, v in plan.items()})
    layers = dict(model.named_modules())
    total, state = len(source.shards[0]), {}
    progress("loading weights", 0, total)
    for i, (name, local, pieces) in enumerate(_local_tensors(source, rank, world_size)):
        if name in plan and name not in source.stored_plan:
            layer = layers[name.removesuffix(".weight")]
            for suffix, tensor in quantize_weight(local, *plan[name][:1], layer.group_size).items():
                state[f"{name.removesuffix('.weight')}.{suffix}"] = tensor.to(device)
        elif local.dtype in _FLOAT_DTYPES:
            if input_major and is_linear_weight(name) and local.shape[0] >= local.shape[1]:
                # Input-major in one copy (converting first, then transposing, would allocate twice).
                tensor = torch.empty(local.shape[::-1], dtype=dtype, device=device).t()
                tensor.copy_(local)
            else:
                tensor = local.to(device=device, dtype=dtype)
            state[name] = tensor
        else:
            state[name] = local.to(device)  # stored int8 / uint8 values and their scales stay as they are
        kept = state.get(name)
        for piece in pieces:
            if kept is None or not _shares_memory(kept, piece):
                release_pages(piece)
        del local, pieces
        # Freed scratch (quantizing's float32 rows, a converted tensor's old copy) stays in glibc's heap
        # unless handed back; without this the heap grew by more than the model from tensor to tensor.
        _return_free_memory()
        progress("loading weights", i + 1, total)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # names or shapes that disagree with the model: a damaged checkpoint
        raise LlamaError(f"{source.ckpt_dir} does not fit the model params.json describes ({str(e).splitlines()[0]})") from None
    model.requires_grad_(False).eval()
    # Re-packing replaces each int4 weight; holding the old ones here would keep the model twice.
    stored_int4 = [(layers[n.removesuffix(".weight")], state[n]) for n, (m, _) in source.stored_plan.items()
                   if m == "int4"]
    state.clear()
    if device.type == "cpu" and dtype == torch.bfloat16:  # the kernels take bf16 activations only
        use_cpu_kernel_layout(model)
    if compiled:
        use_reduction_layout(model)  # the int4 layers the kernel does not take
    for layer, tensor in stored_int4:
        if layer.layout != "format":
            release_pages(tensor)  # re-packed: the file's copy of these bytes is no longer read
    _return_free_memory()
    return model


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        _libc = None


def _return_free_memory() -> None:
    """Hand the scratch that loading freed back to the system (glibc keeps freed heap memory otherwise)."""
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


def release_pages(tensor: torch.Tensor) -> None:
    """Drop a memory-mapped file tensor's pages from this process's resident memory (Linux; elsewhere a no-op).

    Only for tensors that torch.load(mmap=True) returned: their pages are clean and read back from the file
    if touched again. Never call it on ordinary (anonymous) memory, whose contents it would erase.
    """
    if _libc is None or tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    start -= start % _PAGE
    end += -end % _PAGE
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
