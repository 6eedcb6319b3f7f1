"""Convert a Hugging Face LLaMA directory (config.json, safetensors or pytorch_model*.bin weights, and a
tokenizer) into Meta's checkpoint layout.

transformers stores each head's rows of q_proj and k_proj in a different order from Meta's: Meta rotates
adjacent pairs (x[2i], x[2i+1]); transformers' `rotate_half` rotates x[i] with x[i + head_dim/2], so its
conversion script permutes the rows to match. Undoing that permutation is the one change to the numbers.
"""

import json
import math
import mmap
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from llama.io.checkpoint import check_dest, check_state_dict, expected_shapes, model_args, save_checkpoint
from llama.convert.hf_tokenizer import tokenizer_config
from llama.errors import LlamaError
from llama.runtime.files import read_json_object
from llama.model import ModelArgs
from llama.runtime.progress import Progress

# Meta's default rounding of the feed-forward width; hidden_dim is written only when it cannot say the width.
MULTIPLE_OF = 256

# transformers' per-layer names -> Meta's.
_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_NAMES = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}


def meta_params(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab_size: int, hidden_dim: int,
                norm_eps: float, rope_theta: float) -> Dict[str, Any]:
    """params.json fields for a model's shape, in Meta's terms.

    `hidden_dim` is included only when Meta's rule (multiple_of 256, no multiplier) would give another
    width, so LLaMA-2's own shapes convert to params.json files exactly like Meta's.
    """
    params = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
              "vocab_size": vocab_size, "multiple_of": MULTIPLE_OF, "norm_eps": norm_eps, "rope_theta": rope_theta}
    if ModelArgs(**params).ffn_hidden_dim != hidden_dim:
        params["hidden_dim"] = hidden_dim
    return params


def tied_output(state_dict: Dict[str, torch.Tensor]) -> None:
    """Give a model with tied embeddings its own `output.weight`, since Meta's layout has no tying."""
    if "output.weight" not in state_dict and "tok_embeddings.weight" in state_dict:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"].clone()


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a transformers q_proj / k_proj weight in Meta's order (the inverse of transformers' permute).

    Within a head transformers holds the first halves of all rotary pairs, then the second halves;
    Meta interleaves them.
    """
    rows, cols = w.shape
    head_dim = rows // n_heads
    # (n_heads, 2, head_dim // 2, cols) -> (n_heads, head_dim // 2, 2, cols)
    return w.reshape(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def read_hf(src: Path) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], Dict[str, bytes]]:
    """Read a Hugging Face LLaMA directory.

    Returns:
        (params, state_dict, files): params.json fields, the weights with Meta's names and row order, and
        the tokenizer files to write beside them.

    Raises:
        LlamaError: a file is missing, or the model is not a LLaMA this tool can run.
    """
    src = Path(src)
    config = _read_json(src / "config.json")
    model_type = config.get("model_type")
    if model_type not in ("llama", "mistral"):
        raise LlamaError(f"{src / 'config.json'} describes a {model_type!r} model; llama-convert converts LLaMA models only")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise LlamaError(f"{src / 'config.json'} sets {key}, but LLaMA-2's layers have no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise LlamaError(f"{src / 'config.json'} uses activation {config['hidden_act']!r}; LLaMA-2 uses silu")
    rope = config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or (config.get("rope_scaling") or {}).get("rope_type") or (config.get("rope_scaling") or {}).get("type")
    if rope_type not in (None, "default"):
        raise LlamaError(f"{src / 'config.json'} uses {rope_type!r} rope scaling, which this tool does not implement")
    if config.get("sliding_window"):
        raise LlamaError(f"{src / 'config.json'} uses sliding-window attention, which this tool does not implement")

    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
               if not isinstance(config.get(k), int)]
    if missing:
        raise LlamaError(f"{src / 'config.json'} lacks the integer {missing[0]}; it is not a complete LLaMA config")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    if config.get("head_dim") not in (None, dim // n_heads):
        raise LlamaError(f"{src / 'config.json'} sets head_dim {config['head_dim']}, not hidden_size / num_attention_heads")
    params = meta_params(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=n_heads, n_kv_heads=n_kv_heads,
        vocab_size=config["vocab_size"], hidden_dim=config["intermediate_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
    )

    state_dict = {}
    for name, tensor in _read_weights(src).items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by the model
        meta_name = _meta_name(name, src)
        if meta_name.endswith("attention.wq.weight"):
            tensor = unpermute_rotary(tensor, n_heads)
        elif meta_name.endswith("attention.wk.weight"):
            tensor = unpermute_rotary(tensor, n_kv_heads)
        state_dict[meta_name] = tensor
    if config.get("tie_word_embeddings", False):
        # A tied model's lm_head, if saved at all, is the embedding itself.
        state_dict.pop("output.weight", None)
        tied_output(state_dict)
    # The config must describe the tensors the directory holds, or the checkpoint would convert but never load.
    args = model_args(params, max_seq_len=1, max_batch_size=1, source=str(src / "config.json"))
    check_state_dict(state_dict, expected_shapes(args), str(src))
    return params, state_dict, _tokenizer_files(src, config)


def convert_hf(src: Path, dest: Path, overwrite: bool = False, quantize: Optional[str] = None,
               progress: Optional[Progress] = None) -> Path:
    """Convert a Hugging Face LLaMA directory into a checkpoint directory in Meta's layout, atomically.

    Args:
        quantize: None, or "int8" / "int4" to quantize every linear weight (llama/convert/quantize_checkpoint.py).
        progress: told of the tensors quantized and the bytes written.

    Raises:
        LlamaError: as `read_hf`, or `dest` exists and is not empty (without `overwrite`).
    """
    from llama.convert.quantize_checkpoint import check_method, quantize_state_dict

    check_method(quantize)
    check_dest(dest, overwrite)
    params, state_dict, files = read_hf(src)
    if quantize:
        state_dict = quantize_state_dict(state_dict, quantize, progress)
    return save_checkpoint(dest, params, state_dict, overwrite=overwrite, extra_files=files,
                           quantization_source=f"--quantize {quantize} of {Path(src).name}", progress=progress)


def converted_bytes(src: Path) -> int:
    """About how many bytes `convert_hf(src)` writes (no --quantize): the weights as stored, the tokenizer,
    and for a model with tied embeddings a second copy of the embedding (counted in float32, to be safe)."""
    src = Path(src)
    config = _read_json(src / "config.json")
    files = (_weight_files(src, "*.safetensors", "model.safetensors.index.json")
             or _weight_files(src, "pytorch_model*.bin", "pytorch_model.bin.index.json"))
    files += [src / name for name in ("tokenizer.model", "tokenizer.json") if (src / name).is_file()]
    total = sum(f.stat().st_size for f in files)
    if config.get("tie_word_embeddings"):
        total += 4 * int(config.get("vocab_size") or 0) * int(config.get("hidden_size") or 0)
    return total


def _meta_name(name: str, src: Path) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) >= 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        local = ".".join(parts[3:])
        if local in _LAYER_NAMES:
            return f"layers.{parts[2]}.{_LAYER_NAMES[local]}.{suffix}"
    raise LlamaError(f"{src} holds tensor {name}, which a LLaMA model does not have")


def _weight_files(src: Path, pattern: str, index_name: str) -> List[Path]:
    """The weight files of a model: those its index names when there is one, else every file matching `pattern`.

    The index matters where a directory holds other weights too: Mistral-style repositories keep a
    `consolidated.safetensors` (the same model under Meta's names) beside the sharded files.
    """
    index = src / index_name
    if not index.is_file():
        return sorted(src.glob(pattern))
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        raise LlamaError(f"{index} has no weight_map of tensor names to file names; download it again")
    files = []
    for name in sorted(set(weight_map.values())):
        path = src / name
        if Path(name).name != name or not path.is_file():
            raise LlamaError(f"{index} names weight file {name!r}, which is not in {src}; download the missing file")
        files.append(path)
    return files


def _read_weights(src: Path) -> Dict[str, torch.Tensor]:
    """Every weight of the directory, memory-mapped: the model is read from disk as each tensor is used."""
    safetensors = _weight_files(src, "*.safetensors", "model.safetensors.index.json")
    bins = _weight_files(src, "pytorch_model*.bin", "pytorch_model.bin.index.json")
    state_dict: Dict[str, torch.Tensor] = {}
    if safetensors:
        for path in safetensors:
            state_dict.update(_map_safetensors(path))
    elif bins:
        for path in bins:
            try:
                state_dict.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
            except Exception as e:  # torch raises many types for a bad file
                raise LlamaError(f"cannot read {path} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    else:
        raise LlamaError(f"{src} holds no *.safetensors or pytorch_model*.bin weights")
    return state_dict


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _map_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    """A .safetensors file's tensors as views of a private memory map (pages are read when touched).

    The format: an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and
    byte range, then the data.
    """
    def bad(reason: str) -> LlamaError:
        return LlamaError(f"cannot read {path} ({reason}); it is not a complete safetensors file")

    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise bad("it is too short")
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > size - 8:
            raise bad("its header runs past the end")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"its header is not JSON: {e}") from None
        data_len = size - 8 - header_len
        # ACCESS_COPY: a private, writable map, so torch gets a writable buffer and the file is never changed.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if data_len else None
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = [int(n) for n in info["shape"]]
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name} has a dtype, shape or offsets it cannot understand") from None
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if not 0 <= begin <= end <= data_len or end - begin != math.prod(shape) * itemsize:
            raise bad(f"tensor {name}'s bytes do not match its shape")
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=8 + header_len + begin)
        tensors[name] = flat.view(dtype).reshape(shape)
    return tensors


def _tokenizer_files(src: Path, config: Dict[str, Any]) -> Dict[str, bytes]:
    """tokenizer.model (preferred, as Meta ships it) or tokenizer.json, and a tokenizer_config.json."""
    files = {}
    for name in ("tokenizer.model", "tokenizer.json"):
        if (src / name).is_file():
            files[name] = (src / name).read_bytes()
            break
    else:
        raise LlamaError(f"{src} has neither tokenizer.model nor tokenizer.json; copy the model's tokenizer there")

    hf_config = _read_json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").is_file() else {}
    special_map = _read_json(src / "special_tokens_map.json") if (src / "special_tokens_map.json").is_file() else {}
    generation = _read_json(src / "generation_config.json") if (src / "generation_config.json").is_file() else {}
    vocab = _vocab(src, files)

    def token_id(key: str) -> Optional[int]:
        token = hf_config.get(key) or special_map.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None:
            return vocab.get(token)
        token_id = generation.get(f"{key}_id", config.get(f"{key}_id"))
        return token_id[0] if isinstance(token_id, list) else token_id

    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    eos_ids = generation.get("eos_token_id", config.get("eos_token_id"))
    extra_stops = [tokens[i] for i in (eos_ids if isinstance(eos_ids, list) else [])]
    template = hf_config.get("chat_template")
    settings = tokenizer_config(
        tokens, token_id("bos_token"), token_id("eos_token"), token_id("pad_token"),
        # A SentencePiece LLaMA starts every prompt with bos; a tokenizer.json model says whether it does.
        add_bos=hf_config.get("add_bos_token", "tokenizer.model" in files),
        chat_template=template if isinstance(template, str) else None, extra_stop_tokens=extra_stops,
    )
    files["tokenizer_config.json"] = (json.dumps(settings, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files


def _vocab(src: Path, files: Dict[str, bytes]) -> Dict[str, int]:
    if "tokenizer.model" in files:
        from sentencepiece import SentencePieceProcessor

        sp = SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(files["tokenizer.model"])
        except RuntimeError as e:
            raise LlamaError(f"{src / 'tokenizer.model'} is not a SentencePiece model ({e})") from None
        return {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(files["tokenizer.json"].decode("utf-8")).get_vocab(with_added_tokens=True)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise LlamaError(f"{src / 'tokenizer.json'} is not a Hugging Face tokenizer ({str(e).splitlines()[0]})") from None


def _read_json(path: Path) -> Dict[str, Any]:
    return read_json_object(path, "a Hugging Face model directory needs it")
