"""Write small random LLaMA-architecture GGUF files the way llama.cpp lays them out, for tests.

The tensors carry llama.cpp's names and its mix of types: norms in F32, matrices in F16 or Q8_0 (quantized
with the `gguf` package's own reference code). The q and k rows are in Meta's interleaved rotary order, as
llama.cpp's converter leaves them, so a converter to Meta's layout must not permute them.
"""

import os
from pathlib import Path
from typing import Dict, List, Optional, Union

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# One type per tensor kind, mixed as in llama.cpp's quantized files: most matrices Q8_0, some F16, norms F32.
MIXED_TYPES: Dict[str, Q] = {
    "token_embd": Q.Q8_0,
    "attn_norm": Q.F32,
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q8_0,
    "attn_v": Q.F16,
    "attn_output": Q.Q8_0,
    "ffn_norm": Q.F32,
    "ffn_gate": Q.Q8_0,
    "ffn_up": Q.F16,
    "ffn_down": Q.Q8_0,
    "output_norm": Q.F32,
    "output": Q.F16,
}


def write_llama_gguf(
    path: Union[str, os.PathLike],
    *,
    vocab_gguf: Optional[Union[str, os.PathLike]] = None,
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 8,
    n_kv_heads: int = 2,
    hidden: int = 160,
    seed: int = 0,
    types: Optional[Dict[str, Q]] = None,
    std: float = 0.1,
    context_length: int = 128,
    norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
    tied: bool = False,
) -> Path:
    """Write a random-weight LLaMA GGUF file and return its path.

    Args:
        path: the file to write.
        vocab_gguf: a GGUF file whose `llama` (SentencePiece) tokenizer vocabulary to copy, such as
            llama.cpp's ggml-vocab-llama-spm.gguf; None writes a synthetic vocabulary of 300 pieces.
        n_layers, dim, n_heads, n_kv_heads, hidden: the model's shape (`hidden` is the FFN width).
        seed: seed of the weights.
        types: GGML type per tensor kind (keys of MIXED_TYPES), overriding MIXED_TYPES.
        std: standard deviation of the matrices; a large one makes greedy decoding free of near-ties.
        context_length, norm_eps, rope_theta: the remaining llama.* hyperparameters.
        tied: leave out output.weight, as llama.cpp does for a model whose output layer is its embedding (the
            default model, SmolLM2, is one).
    """
    path = Path(path)
    kinds = dict(MIXED_TYPES, **(types or {}))
    tokens, scores, token_types, special = _vocabulary(vocab_gguf)
    head_dim = dim // n_heads

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("random-llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(context_length)
    writer.add_embedding_length(dim)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(hidden)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(len(tokens))

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(special["bos"])
    writer.add_eos_token_id(special["eos"])
    writer.add_unk_token_id(special["unk"])

    rng = np.random.default_rng(seed)

    def add(name: str, kind: str, shape: tuple) -> None:
        # shape is PyTorch's (rows, columns); the writer stores GGUF's reversed dims itself.
        if kind.endswith("norm"):
            # Near 1 but not exactly, so that a norm weight dropped or misplaced changes the logits.
            array = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            array = (std * rng.standard_normal(shape)).astype(np.float32)
        _add_tensor(writer, name, array, kinds[kind])

    add("token_embd.weight", "token_embd", (len(tokens), dim))
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", "attn_norm", (dim,))
        add(f"blk.{i}.attn_q.weight", "attn_q", (n_heads * head_dim, dim))
        add(f"blk.{i}.attn_k.weight", "attn_k", (n_kv_heads * head_dim, dim))
        add(f"blk.{i}.attn_v.weight", "attn_v", (n_kv_heads * head_dim, dim))
        add(f"blk.{i}.attn_output.weight", "attn_output", (dim, n_heads * head_dim))
        add(f"blk.{i}.ffn_norm.weight", "ffn_norm", (dim,))
        add(f"blk.{i}.ffn_gate.weight", "ffn_gate", (hidden, dim))
        add(f"blk.{i}.ffn_up.weight", "ffn_up", (hidden, dim))
        add(f"blk.{i}.ffn_down.weight", "ffn_down", (dim, hidden))
    add("output_norm.weight", "output_norm", (dim,))
    if not tied:
        add("output.weight", "output", (len(tokens), dim))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Where the float16 super-block scales lie in the blocks of the types the gguf package cannot quantize.
RAW_SCALE_OFFSETS = {Q.Q6_K: (208,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q8_1: (0,)}


def random_blocks(rows: int, columns: int, qtype: Q, seed: int = 0) -> np.ndarray:
    """Random raw blocks of `qtype` (rows, bytes per row), their float16 scales small and positive."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * columns // block_size, type_size), dtype=np.uint8)
    for offset in RAW_SCALE_OFFSETS[qtype]:
        scale = (0.001 + 0.01 * rng.random(blocks.shape[0])).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: Q) -> None:
    """Add one float32 array stored as `qtype`.

    The gguf package cannot quantize the k-quants (or Q8_1): those tensors get random valid blocks instead
    of `array`'s values.
    """
    if qtype == Q.F32:
        writer.add_tensor(name, array)
    elif qtype == Q.F16:
        writer.add_tensor(name, array.astype(np.float16))
    elif qtype in RAW_SCALE_OFFSETS:
        seed = int.from_bytes(name.encode()[-4:], "little")
        writer.add_tensor(name, random_blocks(*array.shape, qtype, seed=seed), raw_dtype=qtype)
    else:
        # quantize() returns the raw blocks as uint8 rows; raw_dtype tells the writer their logical shape.
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def _vocabulary(vocab_gguf: Optional[Union[str, os.PathLike]]):
    """(tokens, scores, token types, special ids) copied from a vocab GGUF file, or a synthetic small one."""
    if vocab_gguf is None:
        return _synthetic_vocabulary()
    reader = gguf.GGUFReader(str(vocab_gguf))

    def value(key: str):
        field = reader.get_field(key)
        if field is None:
            raise ValueError(f"{vocab_gguf} lacks {key}")
        return field.contents()

    if value("tokenizer.ggml.model") != "llama":
        raise ValueError(f"{vocab_gguf} does not hold a llama (SentencePiece) vocabulary")
    special = {
        "bos": value("tokenizer.ggml.bos_token_id"),
        "eos": value("tokenizer.ggml.eos_token_id"),
        "unk": value("tokenizer.ggml.unknown_token_id"),
    }
    return value("tokenizer.ggml.tokens"), value("tokenizer.ggml.scores"), value("tokenizer.ggml.token_type"), special


def _synthetic_vocabulary():
    """LLaMA-2's layout in miniature: <unk> <s> </s>, the 256 byte pieces, then 41 word pieces."""
    normal, unknown, control, byte = 1, 2, 3, 6
    tokens: List[str] = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types: List[int] = [unknown, control, control] + [byte] * 256
    words = ["\u2581"] + list("abcdefghijklmnopqrstuvwxyz") + [
        "\u2581t", "he", "\u2581the", "\u2581a", "in", "\u2581of", "\u2581is", "\u2581I", "\u2581life",
        "\u2581meaning", "\u2581believe", "er", "on", "\u2581to",
    ]
    tokens += words
    types += [normal] * len(words)
    # Later pieces score lower, as SentencePiece's BPE merge order requires.
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    return tokens, scores, types, {"bos": 1, "eos": 2, "unk": 0}
