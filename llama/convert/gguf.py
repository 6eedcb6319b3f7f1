"""Convert a GGUF file of LLaMA architecture (llama.cpp's format) into Meta's checkpoint layout.

GGUF keeps Meta's order of the q and k rows: llama.cpp's converter permutes Hugging Face weights back to
the interleaved rotary layout, which is why transformers permutes them again when it loads a GGUF file.
So the weights need only new names and dequantizing. Quantized tensors become float32 (their exact
dequantized values); float tensors keep their type.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from llama.checkpoint import check_dest, check_state_dict, expected_shapes, model_args, save_checkpoint
from llama.convert.gguf_scan import check_gguf_structure
from llama.convert.hf import meta_params, tied_output
from llama.convert.hf_tokenizer import byte_level_tokenizer_json, tokenizer_config
from llama.errors import LlamaError

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


def read_gguf(src: Path) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], Dict[str, bytes]]:
    """Read a LLaMA GGUF file.

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
    try:
        return _read_gguf(src, gguf)
    except LlamaError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError) as e:
        # What a damaged file makes the gguf package or numpy raise: tensors running past the end of the
        # mapped file, duplicate keys, undecodable strings, impossible shapes.
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LlamaError(f"{src} is not a valid GGUF file ({reason}); download it again") from None


def _read_gguf(src: Path, gguf: Any) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], Dict[str, bytes]]:
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

    state_dict = {}
    for tensor in reader.tensors:
        if tensor.name in _IGNORED:
            continue
        state_dict[_meta_name(tensor.name, src)] = _to_torch(tensor, src, gguf)
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
    check_state_dict(state_dict, expected_shapes(args), str(src))
    return params, state_dict, _tokenizer_files(meta, src, tokens)


def convert_gguf(src: Path, dest: Path, overwrite: bool = False) -> Path:
    """Convert a LLaMA GGUF file into a checkpoint directory in Meta's layout, atomically.

    Raises:
        LlamaError: as `read_gguf`, or `dest` exists and is not empty (without `overwrite`).
    """
    check_dest(dest, overwrite)
    params, state_dict, files = read_gguf(src)
    return save_checkpoint(dest, params, state_dict, overwrite=overwrite, extra_files=files)


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
