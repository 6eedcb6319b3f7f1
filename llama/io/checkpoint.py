"""Meta's on-disk checkpoint layout: `params.json` plus `consolidated.NN.pth`, read, checked and written.

A checkpoint directory holds:
    params.json            the model's shape (the fields of ModelArgs, Meta's names)
    consolidated.00.pth    the weights; a model-parallel checkpoint has one file per shard
    tokenizer.model        optional here; Meta ships it one directory up
"""

import json
import math
import os
import shutil
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from llama.quant import format as quant_format
from llama.errors import LlamaError, first_line
from llama.runtime.files import read_json_object
from llama.model import ModelArgs, Transformer
from llama.runtime.progress import Progress, or_silent
from llama.nn.sharding import shard_state_dict, split_dim
from llama.io.tensor_file import TensorFileWriter, TensorSpec

# Meta's checkpoints carry the rotary frequencies as a tensor; the model recomputes them, so it is dropped.
IGNORED_KEYS = ("rope.freqs",)
TOKENIZER_NAMES = ("tokenizer.model", "tokenizer.json")

_RUN_FIELDS = ("max_batch_size", "max_seq_len")
_PARAM_TYPES = {f.name: f.type for f in fields(ModelArgs) if f.name not in _RUN_FIELDS}
_INT_LIMITS = {"dim": 1 << 16, "n_layers": 1024, "n_heads": 1024, "n_kv_heads": 1024, "vocab_size": 1 << 22,
               "multiple_of": 1 << 16, "hidden_dim": 1 << 20}
_INT_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "hidden_dim")
_FLOAT_FIELDS = ("ffn_dim_multiplier", "norm_eps", "rope_theta")


def read_params(ckpt_dir: Path) -> Dict:
    """The contents of `ckpt_dir/params.json`, checked for unknown fields and wrong types."""
    path = Path(ckpt_dir) / "params.json"
    params = read_json_object(path, "a checkpoint directory needs params.json beside its weights")
    unknown = sorted(set(params) - set(_PARAM_TYPES))
    if unknown:
        # An unknown field may change what the model computes (a new rope scaling, say); ignoring it would
        # give wrong text without a word.
        raise LlamaError(f"{path} has fields this tool does not understand: {', '.join(unknown)}")
    for name, value in params.items():
        if value is None and name in ("n_kv_heads", "ffn_dim_multiplier", "hidden_dim"):
            continue
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if name in _INT_FIELDS and not is_int:
            raise LlamaError(f"{path}: {name} must be an integer, not {value!r}")
        if name in _FLOAT_FIELDS and not (is_int or isinstance(value, float)):
            raise LlamaError(f"{path}: {name} must be a number, not {value!r}")
    return params


def model_args(params: Dict, max_seq_len: int, max_batch_size: int, tokenizer_vocab: Optional[int] = None,
               source: str = "params.json") -> ModelArgs:
    """ModelArgs from a params dict, with `vocab_size: -1` resolved from the tokenizer and the shape checked."""
    args = ModelArgs(max_seq_len=max_seq_len, max_batch_size=max_batch_size, **params)
    if args.vocab_size == -1:
        if tokenizer_vocab is None:
            raise LlamaError(f"{source} has vocab_size -1 (take it from the tokenizer) but no tokenizer was given")
        args.vocab_size = tokenizer_vocab
    elif tokenizer_vocab is not None and tokenizer_vocab > args.vocab_size:
        raise LlamaError(
            f"the tokenizer has {tokenizer_vocab} tokens but the model only {args.vocab_size}: "
            "they do not belong together"
        )
    # Upper bounds far above any real model (LLaMA-2 70B: dim 8192, 80 layers, 28672-wide feed-forward), so
    # that a damaged file fails here rather than in a huge allocation or an endless model build.
    for name, limit in _INT_LIMITS.items():
        value = getattr(args, name)
        if value is not None and not 0 < value <= limit:
            raise LlamaError(f"{source}: {name} must be between 1 and {limit}, not {value}")
    for name in ("norm_eps", "rope_theta", "ffn_dim_multiplier"):
        value = getattr(args, name)
        if value is not None and not (_finite(value) and value > 0):
            raise LlamaError(f"{source}: {name} must be a positive finite number, not {value}")
    if args.ffn_dim_multiplier is not None and args.ffn_dim_multiplier > 16:
        raise LlamaError(f"{source}: ffn_dim_multiplier {args.ffn_dim_multiplier} is implausible (LLaMA-2 70B uses 1.3)")
    if not 0 < args.ffn_hidden_dim <= _INT_LIMITS["hidden_dim"]:
        raise LlamaError(f"{source}: the feed-forward width works out to {args.ffn_hidden_dim}, which is not sensible")
    if args.dim % args.n_heads:
        raise LlamaError(f"{source}: dim {args.dim} is not divisible by n_heads {args.n_heads}")
    if args.n_heads % args.n_kv_heads:
        raise LlamaError(f"{source}: n_heads {args.n_heads} is not divisible by n_kv_heads {args.n_kv_heads}")
    if args.head_dim % 2:
        raise LlamaError(f"{source}: head width dim / n_heads = {args.head_dim} must be even for rotary embeddings")
    if max_seq_len <= 0 or max_batch_size <= 0:
        raise LlamaError(f"max_seq_len and max_batch_size must be positive, not {max_seq_len} and {max_batch_size}")
    return args


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large to be a float
        return False


def shard_paths(ckpt_dir: Path) -> List[Path]:
    """The checkpoint's weight files, in shard order, checked to be consolidated.00 .. consolidated.NN."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise LlamaError(f"checkpoint directory {ckpt_dir} does not exist")
    paths = sorted(ckpt_dir.glob("consolidated.*.pth"))
    if not paths:
        raise LlamaError(f"{ckpt_dir} holds no consolidated.NN.pth weight files")
    expected = [f"consolidated.{i:02d}.pth" for i in range(len(paths))]
    if [p.name for p in paths] != expected:
        raise LlamaError(
            f"{ckpt_dir} holds shards {', '.join(p.name for p in paths)}; expected {', '.join(expected)}"
        )
    return paths


def load_shard(path: Path) -> Dict[str, torch.Tensor]:
    """One weight file, memory-mapped, through the weights-only unpickler that never runs code from the file."""
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types for a bad file; all mean "this is not a checkpoint"
        reason = first_line(e)
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            reason = "it holds objects other than tensors, and loading it could run code"
        raise LlamaError(f"cannot load {path}: {reason}") from None
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise LlamaError(f"{path} does not hold a dictionary of tensors")
    return state_dict


def check_names(names: Iterable[str], expected: Iterable[str], source: str) -> None:
    """Raise naming the first tensor that is missing or unexpected (and how many more there are)."""
    names, expected = list(names), list(expected)
    for what, extra in (("is missing", [k for k in expected if k not in set(names)]),
                        ("has unexpected", [k for k in names if k not in set(expected)])):
        if extra:
            more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
            raise LlamaError(f"{source} {what} tensor {extra[0]}{more}")


def check_state_dict(state_dict: Dict[str, torch.Tensor], expected: Dict[str, torch.Size], source: str) -> None:
    """Raise naming the first tensor that is missing, unexpected, or of the wrong shape."""
    check_names(state_dict, expected, source)
    for name, shape in expected.items():
        if state_dict[name].shape != shape:
            raise LlamaError(
                f"{source}: tensor {name} has shape {tuple(state_dict[name].shape)}, params.json implies {tuple(shape)}"
            )


_SHAPES: Dict[str, Dict[str, torch.Size]] = {}


def expected_shapes(args: ModelArgs) -> Dict[str, torch.Size]:
    """Every tensor's name and shape in the model `args` describes (worked out once per `args`: loading asks thrice)."""
    key = repr(args)
    if key not in _SHAPES:
        with torch.device("meta"):
            _SHAPES[key] = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    return dict(_SHAPES[key])


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CheckpointReader:
    """A checkpoint's weight files, opened memory-mapped and checked once; each rank's tensors on demand.

    Every reader of Meta's layout goes through this: loading a model, converting or quantizing a
    checkpoint, `load_checkpoint`. Opening reads no weight: pages are read as tensors are touched.

    Attributes:
        ckpt_dir: the directory.
        paths: consolidated.00.pth .. consolidated.NN.pth.
        shards: each file's tensors (memory-mapped), without the keys the model ignores.
        record: quantization.json's contents, or None for a float checkpoint.
        stored_plan: weight name -> (method, group size or None) for the weights the files hold quantized.
    """

    def __init__(self, ckpt_dir: Path):
        """Open `ckpt_dir`'s shards. Raises LlamaError for a missing, misnamed, unreadable or mismatched shard."""
        self.ckpt_dir = Path(ckpt_dir)
        self.paths = shard_paths(self.ckpt_dir)
        self.shards = [_without_ignored(load_shard(path)) for path in self.paths]
        for path, shard in zip(self.paths[1:], self.shards[1:]):
            if set(shard) != set(self.shards[0]):
                raise LlamaError(f"{path} does not hold the same tensor names as {self.paths[0]}")
        self.record = quant_format.read_record(self.ckpt_dir)
        self.stored_plan: quant_format.Plan = {}

    @property
    def names(self) -> List[str]:
        return list(self.shards[0])

    @property
    def float_dtype(self) -> Optional[torch.dtype]:
        """The dtype of the checkpoint's float tensors (the first one found)."""
        return next((t.dtype for t in self.shards[0].values() if t.dtype in _FLOAT_DTYPES), None)

    def check(self, args: ModelArgs) -> Dict[str, torch.Size]:
        """Check every tensor against the model `args` describes; returns the whole model's stored shapes.

        Learns which weights are stored quantized (`stored_plan`) on the way: their shapes are those of
        llama/quant/format.py's layout.

        Raises:
            LlamaError: a tensor is missing, unexpected or of the wrong shape, or the quantization record
                and the tensors disagree.
        """
        full = expected_shapes(args)
        self.stored_plan = self._learn_stored_plan(full)
        stored = quant_format.quantized_shapes(full, {n: (m, g or full[n][1]) for n, (m, g) in self.stored_plan.items()})
        check_names(self.shards[0], stored, str(self.ckpt_dir))
        n = len(self.shards)
        for name, shape in stored.items():
            pieces = [s[name].shape for s in self.shards]
            dim = split_dim(name)
            if dim is None or n == 1:
                merged, fits = pieces[0], all(p == pieces[0] for p in pieces)
            else:
                merged = list(pieces[0])
                merged[dim] = sum(p[dim] for p in pieces)
                merged = torch.Size(merged)
                fits = all(len(p) == len(shape) and all(p[d] == pieces[0][d] for d in range(len(p)) if d != dim)
                           for p in pieces)
            if not fits or merged != shape:
                where = self.paths[0] if n == 1 else self.ckpt_dir
                got = tuple(pieces[0]) if n == 1 else f"{tuple(merged)} (joined from {n} shards)"
                raise LlamaError(f"{where}: tensor {name} has shape {got}, params.json implies {tuple(shape)}")
        return stored

    def _learn_stored_plan(self, full: Dict[str, torch.Size]) -> quant_format.Plan:
        first, plan = self.shards[0], {}
        for name, shape in full.items():
            method = quant_format.method_of(first, name) if quant_format.may_be_stored_quantized(name) else None
            if method is None:
                continue
            scales = first[name.removesuffix(".weight") + ".scales"]
            n_groups = scales.shape[-1] * (len(self.shards) if split_dim(name) == 1 else 1)
            if scales.ndim != 2 or n_groups == 0 or shape[1] % n_groups:
                raise LlamaError(f"{self.ckpt_dir}: {name}'s scales have shape {tuple(scales.shape)}, which does not "
                                 f"group its {shape[1]} input columns")
            group_size = shape[1] // n_groups
            if method == "int4" and group_size % 2:
                raise LlamaError(f"{self.ckpt_dir}: {name} is int4 in groups of {group_size} columns; int4 packs "
                                 "columns in pairs within each group, so the checkpoint is damaged")
            plan[name] = (method, None if method == "int8" and n_groups == 1 else group_size)
        if plan and self.record is None:
            raise LlamaError(f"{self.ckpt_dir} holds quantized weights but no {quant_format.RECORD_NAME}; "
                             "the checkpoint is incomplete")
        if self.record is not None and not plan:
            raise LlamaError(f"{self.ckpt_dir} has {quant_format.RECORD_NAME} but its weights are not quantized; "
                             "the checkpoint is damaged")
        return plan

    def tensors(self, rank: int = 0, world_size: int = 1) -> Iterator[Tuple[str, torch.Tensor, List[torch.Tensor]]]:
        """(name, this rank's slice, the file tensors it came from) for every tensor, in file order.

        A checkpoint of as many shards as ranks gives each rank its own shard's tensors, as Meta's reference
        reads them; any other count joins each tensor from its pieces and takes the rank's slice, so N shards
        load on M processes (1 included). Call `check` first.
        """
        n = len(self.shards)
        for name in self.names:
            pieces = [shard[name] for shard in self.shards]
            dim = split_dim(name)
            if n == world_size:
                local = pieces[rank]
            else:
                whole = pieces[0] if dim is None or n == 1 else torch.cat(pieces, dim=dim)
                local = whole if dim is None or world_size == 1 else torch.chunk(whole, world_size, dim=dim)[rank]
            yield name, local, pieces


def load_checkpoint(ckpt_dir: Path, args: ModelArgs, rank: int = 0, world_size: int = 1) -> Dict[str, torch.Tensor]:
    """This rank's weights, checked against `args`, as they are stored (memory-mapped; see CheckpointReader)."""
    reader = CheckpointReader(ckpt_dir)
    reader.check(args)
    return {name: local for name, local, _ in reader.tensors(rank, world_size)}


def _without_ignored(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    for key in IGNORED_KEYS:
        state_dict.pop(key, None)
    return state_dict


def local_shapes(full_shapes: Dict[str, torch.Size], world_size: int) -> Dict[str, torch.Size]:
    """The shape of each rank's slice of every tensor, for `world_size` ranks."""
    local = {}
    for name, shape in full_shapes.items():
        dim, shape = split_dim(name), list(shape)
        if dim is not None:
            shape[dim] //= world_size
        local[name] = torch.Size(shape)
    return local


def tokenizer_beside(ckpt_dir: Path) -> Optional[Path]:
    """The tokenizer file of a checkpoint, inside it or one level up as Meta's downloads place it; or None."""
    return next((p for p in _tokenizer_candidates(ckpt_dir) if p.is_file()), None)


def find_tokenizer(ckpt_dir: Path) -> Path:
    """`tokenizer_beside(ckpt_dir)`, or a LlamaError saying where it looked."""
    path = tokenizer_beside(ckpt_dir)
    if path is None:
        raise LlamaError(
            f"no tokenizer found for {ckpt_dir} (looked for {', '.join(str(p) for p in _tokenizer_candidates(ckpt_dir))}); "
            "pass its path with tokenizer_path="
        )
    return path


def _tokenizer_candidates(ckpt_dir: Path) -> List[Path]:
    ckpt_dir = Path(ckpt_dir)
    return [d / name for d in (ckpt_dir, ckpt_dir.parent) for name in TOKENIZER_NAMES]


def check_dest(dest: Path, overwrite: bool) -> None:
    """Refuse a destination that holds something, unless asked to overwrite it.

    Converters call this before their slow work; the atomic writer calls it again when it writes.
    """
    dest = Path(dest)
    if dest.exists() and not overwrite and (not dest.is_dir() or any(dest.iterdir())):
        raise LlamaError(f"{dest} already exists and is not empty; choose a new directory or pass overwrite=True")


def _write_dir_atomically(dest: Path, write, overwrite: bool) -> None:
    """Run write(tmp_dir), then rename the finished directory to `dest`; nothing appears under `dest` on failure."""
    dest = Path(dest)
    check_dest(dest, overwrite)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; a checkpoint is ordinary readable data
        if dest.exists() or dest.is_symlink():
            # Moved aside rather than deleted first, so a failed rename below can put it back.
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            dest.rename(old)
            try:
                tmp.rename(dest)
            except BaseException:
                old.rename(dest)
                raise
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()  # a file (or a link) in the way; rmtree would refuse it and leave it hidden
        else:
            tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(ckpt_dir: Path, params: Dict, state_dict: Dict[str, torch.Tensor], num_shards: int = 1,
                    tokenizer_path: Optional[Path] = None, overwrite: bool = False,
                    extra_files: Optional[Dict[str, bytes]] = None, quantization_source: str = "",
                    progress: Optional[Progress] = None) -> Path:
    """Write a checkpoint in Meta's exact layout, atomically.

    Quantized weights (`P.weight` int8 or packed int4 with `P.scales` and `P.mins`, llama/quant/format.py)
    are written as they are, and the directory records their quantization in quantization.json, so that
    loading needs no flag. Every file loads with `torch.load(weights_only=True)`.

    Args:
        ckpt_dir: the directory to create.
        params: the params.json fields.
        state_dict: the whole model's weights with Meta's names, float or quantized.
        num_shards: how many model-parallel shards to split the weights into.
        tokenizer_path: a tokenizer file to copy in beside the weights, as tokenizer.model (or
            tokenizer.json for a Hugging Face one).
        overwrite: replace an existing non-empty directory.
        extra_files: more files to write beside the weights, by name, inside the same atomic step.
        quantization_source: where quantized weights came from, for the record (e.g. "GGUF Q4_0").
        progress: told of the bytes written.

    Raises:
        LlamaError: the destination exists, the weights do not split into `num_shards`, or a write failed.
    """
    check_splits({k: v.shape for k, v in state_dict.items()}, num_shards)
    record = quant_format.record_for(state_dict, quantization_source)
    extra_files = dict(extra_files or {}, **({quant_format.RECORD_NAME: record} if record else {}))
    shards = shard_state_dict(state_dict, num_shards)
    specs = [{k: (v.shape, v.dtype) for k, v in shard.items()} for shard in shards]

    def fill(writers: List[TensorFileWriter]) -> None:
        done, total = 0, sum(t.numel() * t.element_size() for t in state_dict.values())
        for name in state_dict:
            for writer, shard in zip(writers, shards):
                writer.write(name, shard[name])
            done += state_dict[name].numel() * state_dict[name].element_size()
            or_silent(progress)("writing checkpoint", done, total)

    return write_checkpoint_files(ckpt_dir, params, specs, fill, tokenizer_path, overwrite, extra_files)


def write_checkpoint_files(ckpt_dir: Path, params: Dict, shard_specs: List[Dict[str, TensorSpec]],
                           fill: Callable[[List[TensorFileWriter]], None], tokenizer_path: Optional[Path] = None,
                           overwrite: bool = False, extra_files: Optional[Dict[str, bytes]] = None) -> Path:
    """Write a checkpoint directory atomically, its weight files filled one tensor at a time.

    Args:
        shard_specs: for each consolidated.NN.pth, its tensors' names, shapes and dtypes.
        fill: called with one `TensorFileWriter` per shard; it writes every tensor of each.
        The rest: as for `save_checkpoint`.
    """

    def write(tmp: Path) -> None:
        (tmp / "params.json").write_text(json.dumps(params, indent=2) + "\n")
        writers = []
        try:
            for i, specs in enumerate(shard_specs):
                writers.append(TensorFileWriter(tmp / f"consolidated.{i:02d}.pth", specs))
            fill(writers)
        finally:
            for writer in writers:
                writer.close()
        for writer in writers:
            writer.check_complete()
        if tokenizer_path is not None:
            name = "tokenizer.json" if str(tokenizer_path).endswith(".json") else "tokenizer.model"
            shutil.copyfile(tokenizer_path, tmp / name)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)

    try:
        _write_dir_atomically(Path(ckpt_dir), write, overwrite)
    except (OSError, RuntimeError) as e:
        # torch.save reports a failed write (a full disk, a file-size limit) as a RuntimeError.
        reason = getattr(e, "strerror", None) or "a write failed"
        raise LlamaError(f"could not write {ckpt_dir} ({reason}); is the disk full? Nothing was left behind") from None
    return Path(ckpt_dir)


def check_splits(shapes: Dict[str, torch.Size], num_shards: int) -> None:
    if num_shards < 1:
        raise LlamaError(f"the number of shards must be at least 1, not {num_shards}")
    for name, shape in shapes.items():
        dim = split_dim(name)
        if dim is not None and dim < len(shape) and shape[dim] % num_shards:
            raise LlamaError(f"{name} of shape {tuple(shape)} does not split into {num_shards} shards; "
                             "choose a number of shards that divides it")


def params_dict(args: ModelArgs) -> Dict:
    """The params.json fields of `args`, leaving out the optional ones that are unset."""
    params = {name: getattr(args, name) for name in _PARAM_TYPES}
    return {k: v for k, v in params.items() if not (v is None and k in ("ffn_dim_multiplier", "hidden_dim"))}
