"""Convert a GGUF file of LLaMA architecture (llama.cpp's format) into Meta's checkpoint layout.

GGUF keeps Meta's order of the q and k rows: llama.cpp's converter permutes Hugging Face weights back to
the interleaved rotary layout, which is why transformers permutes them again when it loads a GGUF file.
So the weights need only new names. Linear layers' weights and the embedding of types Q8_0, Q4_0 and Q4_1
stay quantized, exactly (llama/convert/gguf_quant.py; a model looks the embedding's rows up in those blocks,
llama/quant/embedding.py), and linear weights of the k-quants Q6_K, Q4_K and Q5_K become the nearest of our formats;
other quantized types, and an embedding of a k-quant, become float32 (their exact dequantized values); float
tensors keep their type. A model with tied embeddings gets an output layer of its own (Meta's layout has no
tying), held as the embedding's type is.
"""

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from llama.quant import format as quant_format
from llama.io.checkpoint import check_dest, check_state_dict, expected_shapes, model_args, save_checkpoint
from llama.convert.gguf_quant import EXACT_TYPES, KEPT_TYPES, dequantize_exact, keep_quantized
from llama.convert.gguf_scan import GGUFLayout, check_gguf_structure
from llama.convert.hf import meta_params, tied_output
from llama.convert.hf_tokenizer import byte_level_tokenizer_json, tokenizer_config
from llama.convert.quantize_checkpoint import add_quantized, check_method, quantize_tensor
from llama.errors import LlamaError
from llama.runtime.progress import Progress, or_silent

ARCHITECTURE = "llama"

# GGUF's per-layer names -> Meta's.
_LAYER_NAMES = {
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_gate": "feed_forward.w1",
    "ffn_down": "feed_forward.w2",
    "ffn_up": "feed_forward.w3",
    "attn_norm": "attention_norm",
    "ffn_norm": "ffn_norm",
}
_TOP_NAMES = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}
# Tensors llama.cpp may add that the model recomputes.
_IGNORED = ("rope_freqs.weight",)


def read_gguf(src: Path, dequantize: bool = False, quantize: Optional[str] = None,
              notice: Optional[Callable[[str], None]] = None,
              progress: Optional[Progress] = None) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], Dict[str, bytes]]:
    """Read a LLaMA GGUF file, keeping quantized linear weights quantized (see the module's docstring).

    Args:
        src: the .gguf file.
        dequantize: make every tensor float instead, as stored values dequantized.
        quantize: "int8" or "int4": every linear weight ends in that method; weights already quantized
            with it are kept, all others are dequantized and quantized again.
        notice: told, once per GGUF type, what became of its tensors (one line each).
        progress: told of the tensors read.

    Returns:
        (params, state_dict, files): params.json fields, the weights with Meta's names, and the tokenizer
        files to write beside them (tokenizer.model or tokenizer.json, and tokenizer_config.json).

    Raises:
        LlamaError: the file is missing, not GGUF, truncated, or not a LLaMA model this tool can run.
    """
    import gguf

    src = Path(src)
    if not src.is_file():
        raise LlamaError(f"GGUF file {src} does not exist; check the path")
    check_gguf_structure(src)
    check_method(quantize)
    if dequantize and quantize:
        raise LlamaError("dequantize=True and quantize= contradict each other; pass one")
    try:
        return _read_gguf(src, gguf, dequantize, quantize, notice, progress)
    except LlamaError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError) as e:
        # What a damaged file makes the gguf package or numpy raise: tensors running past the end of the
        # mapped file, duplicate keys, undecodable strings, impossible shapes.
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LlamaError(f"{src} is not a valid GGUF file ({reason}); download it again") from None


def _read_gguf(src: Path, gguf: Any, dequantize: bool, quantize: Optional[str], notice: Optional[Callable[[str], None]],
               progress: Optional[Progress]) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], Dict[str, bytes]]:
    reader = gguf.GGUFReader(src)
    meta = _Metadata(reader, src)
    arch = meta.get("general.architecture")
    if arch != ARCHITECTURE:
        raise LlamaError(f"{src} holds a {arch!r} model; llama-convert converts GGUF files of llama architecture only")
    if (meta.get(f"{arch}.expert_count") or 0) > 0:
        raise LlamaError(f"{src} is a mixture-of-experts model, which this tool does not implement")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise LlamaError(f"{src} uses {scaling!r} rope scaling, which this tool does not implement")

    state_dict: Dict[str, torch.Tensor] = {}
    methods: Dict[str, Tuple[str, int]] = {}  # quantized weight -> (method, group size), for the shape check
    fates: Dict[str, Counter] = {}  # GGUF type -> what became of its tensors -> how many
    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    tensors = [(_meta_name(t.name, src), t) for t in reader.tensors if t.name not in _IGNORED]
    names = [name for name, _ in tensors]
    if "output.weight" not in names and "tok_embeddings.weight" in names:
        # Tied embeddings: the output layer is the embedding's matrix, and a quantized one stays quantized there.
        tensors.append(("output.weight", tensors[names.index("tok_embeddings.weight")][1]))
    for i, (name, tensor) in enumerate(tensors):
        type_name = tensor.tensor_type.name
        parts, fate = None, None if tensor.tensor_type in float_types else "dequantized to float32"
        shape = tuple(int(n) for n in reversed(tensor.shape))
        linear = quant_format.is_linear_weight(name) and not dequantize and len(shape) == 2
        kept_as = KEPT_TYPES.get(type_name)
        # The embedding's blocks are kept whatever `quantize` says: they are the file's values exactly.
        if (linear and kept_as is not None and quantize in (None, kept_as[0])
                or _keeps_embedding(name, type_name, len(shape), dequantize)):
            parts = keep_quantized(type_name, tensor.data, shape, lambda: _to_torch(tensor, src, gguf))
            fate = kept_as[2] if parts is not None else "dequantized to float32 (a scale beyond float16's range)"
        if linear and parts is None and quantize is not None:
            parts = quantize_tensor(_to_torch(tensor, src, gguf), quantize, name)
            fate = f"quantized to {quantize}"
        if parts is not None:
            add_quantized(state_dict, name, parts)
            scales = parts["scales"]
            group = parts["weight"].shape[1] * (2 if "mins" in parts else 1) // scales.shape[1]
            methods[name] = ("int4" if "mins" in parts else "int8", group)
        else:
            state_dict[name] = _to_torch(tensor, src, gguf)
        if fate is not None:
            fates.setdefault(type_name, Counter())[fate] += 1
        or_silent(progress)("reading GGUF tensors", i + 1, len(tensors))
    for type_name, counts in fates.items():
        for fate, n in counts.items():
            (notice or _ignore)(f"{n} {type_name} tensor{'s' if n > 1 else ''}: {fate}")
    tied_output(state_dict)

    dim, n_heads = meta.require(f"{arch}.embedding_length"), meta.require(f"{arch}.attention.head_count")
    if not (isinstance(dim, int) and isinstance(n_heads, int) and dim > 0 and n_heads > 0):
        raise LlamaError(f"{src} gives embedding_length {dim} and head_count {n_heads}; both must be positive")
    tokens = meta.get("tokenizer.ggml.tokens")
    embeddings = state_dict.get("tok_embeddings.weight")
    if embeddings is None:
        raise LlamaError(f"{src} has no token_embd.weight tensor; it is not a complete model")
    if meta.get(f"{arch}.rope.dimension_count") not in (None, dim // n_heads):
        raise LlamaError(f"{src} applies rotary embeddings to {meta.get(f'{arch}.rope.dimension_count')} of each "
                         f"head's {dim // n_heads} dimensions; this tool rotates whole heads only")
    params = meta_params(
        dim=dim, n_layers=meta.require(f"{arch}.block_count"), n_heads=n_heads,
        n_kv_heads=meta.get(f"{arch}.attention.head_count_kv") or n_heads,
        # The embedding's rows are the truth; the vocab_size key is optional in GGUF.
        vocab_size=embeddings.shape[0], hidden_dim=meta.require(f"{arch}.feed_forward_length"),
        norm_eps=_float32_value(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_float32_value(meta.get(f"{arch}.rope.freq_base") or 10000.0),
    )
    if tokens is None:
        raise LlamaError(f"{src} carries no tokenizer vocabulary (tokenizer.ggml.tokens); it cannot be run without one")
    # The metadata must describe the tensors the file holds, or the checkpoint would convert but never load.
    args = model_args(params, max_seq_len=1, max_batch_size=1, source=str(src))
    check_state_dict(state_dict, quant_format.quantized_shapes(expected_shapes(args), methods), str(src))
    return params, state_dict, _tokenizer_files(meta, src, tokens)


def convert_gguf(src: Path, dest: Path, overwrite: bool = False, dequantize: bool = False,
                 quantize: Optional[str] = None, notice: Optional[Callable[[str], None]] = None,
                 progress: Optional[Progress] = None) -> Path:
    """Convert a LLaMA GGUF file into a checkpoint directory in Meta's layout, atomically.

    Quantized weights stay quantized, and the directory's quantization.json says how (see `read_gguf`
    for `dequantize`, `quantize`, `notice` and `progress`).

    Raises:
        LlamaError: as `read_gguf`, or `dest` exists and is not empty (without `overwrite`).
    """
    check_dest(dest, overwrite)
    params, state_dict, files = read_gguf(src, dequantize, quantize, notice, progress)
    source = f"GGUF {Path(src).name}" + (f", --quantize {quantize}" if quantize else "")
    return save_checkpoint(dest, params, state_dict, overwrite=overwrite, extra_files=files,
                           quantization_source=source, progress=progress)


def converted_bytes(src: Path, layout: Optional[GGUFLayout] = None) -> int:
    """About how many bytes `convert_gguf(src)` writes (no --quantize or --dequantize), from the tensor table
    alone (`layout`, scanned from `src` when not given): the rules of `read_gguf` applied to sizes."""
    import gguf

    layout = layout if layout is not None else check_gguf_structure(Path(src))
    names = {name for name, _, _ in layout.tensors}
    tensors = [(name, dims, code) for name, dims, code in layout.tensors if name not in _IGNORED]
    tensors += [("output.weight", dims, code) for name, dims, code in layout.tensors  # tied: a copy for the output
                if name == "token_embd.weight" and "output.weight" not in names]
    # The tokenizer files rebuilt from the metadata are about the metadata's size; twice it, to be safe.
    total = 2 * layout.header_bytes
    for name, dims, code in tensors:
        numel = math.prod(dims)
        try:
            type_name = gguf.GGMLQuantizationType(code).name
        except ValueError:
            type_name = None
        meta_name = name if name == "output.weight" else _meta_name(name, Path(src))
        kept = quant_format.is_linear_weight(meta_name) and len(dims) == 2 and type_name in KEPT_TYPES
        if kept or _keeps_embedding(meta_name, type_name, len(dims), dequantize=False):
            method, group = KEPT_TYPES[type_name][:2]
            # int8: a byte per value, a float16 scale per group; int4: half a byte, a float16 scale and min.
            total += numel + 2 * numel // group if method == "int8" else numel // 2 + 4 * numel // group
        else:
            total += numel * {"F16": 2, "BF16": 2}.get(type_name, 4)
    return total


def _keeps_embedding(name: str, type_name: str, n_dims: int, dequantize: bool) -> bool:
    """Whether a GGUF tensor is the embedding in a type whose blocks are kept: the three that map exactly, so
    that its rows are the file's very values (a k-quant's nearest format rounds its scales to float16)."""
    return name == quant_format.EMBEDDING_WEIGHT and type_name in EXACT_TYPES and n_dims == 2 and not dequantize


def _ignore(line: str) -> None:
    """The notice callback for callers who want no notices."""


def _float32_value(value: float) -> float:
    """The shortest decimal that is the same float32: GGUF stores 1e-5 as 9.999999747378752e-06."""
    return float(str(np.float32(value)))


class _Metadata:
    """A GGUF file's key-value metadata, decoded on demand."""

    def __init__(self, reader: Any, src: Path):
        self.reader, self.src = reader, src

    def get(self, key: str) -> Optional[Any]:
        field = self.reader.get_field(key)
        return None if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise LlamaError(f"{self.src} lacks the metadata key {key}; it is not a complete LLaMA GGUF file")
        return value


def _meta_name(name: str, src: Path) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise LlamaError(f"{src} holds tensor {name}, which a LLaMA model does not have")


def _to_torch(tensor: Any, src: Path, gguf: Any) -> torch.Tensor:
    """One tensor in PyTorch's (rows, columns) order: floats as stored, quantized ones dequantized to float32."""
    qtype = gguf.GGMLQuantizationType
    # GGUF lists dimensions fastest-first; PyTorch wants them slowest-first.
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.tensor_type in (qtype.F32, qtype.F16):
        array = np.ascontiguousarray(tensor.data)
        return torch.from_numpy(array.copy()).reshape(shape)
    if tensor.tensor_type == qtype.BF16:
        # numpy has no bfloat16: reinterpret the raw bytes as int16 and view them as bf16 in torch.
        raw = np.ascontiguousarray(tensor.data).view(np.int16).copy()
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    if tensor.tensor_type.name in EXACT_TYPES and len(shape) == 2:
        return dequantize_exact(tensor.tensor_type.name, tensor.data, shape)
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise LlamaError(f"{src} stores {tensor.name} as {tensor.tensor_type.name}, which the gguf package cannot "
                         "dequantize; convert a file of another quantization type") from None
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(shape)


def _tokenizer_files(meta: _Metadata, src: Path, tokens: List[str]) -> Dict[str, bytes]:
    """tokenizer.model for a SentencePiece vocabulary, tokenizer.json for a byte-level BPE one, and the config."""
    model = meta.get("tokenizer.ggml.model")
    files: Dict[str, bytes] = {}
    if model == "llama":
        from llama.convert.spm_from_gguf import sentencepiece_model_from_gguf

        files["tokenizer.model"] = sentencepiece_model_from_gguf(meta.reader)
        add_bos_default = True  # llama.cpp's default for a SentencePiece vocabulary
    elif model == "gpt2":
        files["tokenizer.json"] = byte_level_tokenizer_json(
            tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.token_type"),
            meta.get("tokenizer.ggml.pre"), str(src))
        add_bos_default = False
    else:
        raise LlamaError(f"{src} has a {model!r} tokenizer; llama-convert knows llama (SentencePiece) and gpt2 (BPE) ones")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    settings = tokenizer_config(
        tokens, meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id"),
        meta.get("tokenizer.ggml.padding_token_id"), add_bos=add_bos_default if add_bos is None else add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
        extra_stop_tokens=[tokens[meta.get("tokenizer.ggml.eot_token_id")]] if meta.get("tokenizer.ggml.eot_token_id") is not None else [],
    )
    files["tokenizer_config.json"] = (json.dumps(settings, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files
