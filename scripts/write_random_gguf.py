"""Write a random-weight LLaMA GGUF file of Meta's shapes, quantized, for conversion and size benchmarks.

    python scripts/write_random_gguf.py /work/big/llama-7b-q4_0.gguf --size 7B --type Q4_0
    python scripts/write_random_gguf.py /tmp/small.gguf --size 7B --n_layers 4 --type Q8_0
    python scripts/write_random_gguf.py /work/big/7b-8l-F16.gguf --size 7B --n_layers 8 --type F16

The linear layers and the embedding are random valid blocks of `--type` (Q4_0, Q4_1 or Q8_0: random
values with small positive scales) or, with F16, float16 values drawn from N(0, 0.02^2), for llama.cpp's own
quantizer to make its types from; the norms float32 ones, as in llama.cpp's files of that type. The
vocabulary is LLaMA-2's (`llama-download llama2-tokenizer` fetches it). The file is written one tensor at
a time, so memory stays at one tensor whatever the size.
"""

from pathlib import Path
from typing import Optional

import fire
import numpy as np

from llama.io.checkpoint import model_args
from llama.io.random_weights import PRESETS
from llama.cli.printer import ProgressPrinter
from llama.errors import LlamaError

# Offsets of the float16 fields in a block of each type: (scale d, min m or None).
BLOCK_FIELDS = {"Q4_0": (0, None), "Q4_1": (0, 2), "Q8_0": (0, None)}


def random_blocks(rng: np.random.Generator, rows: int, columns: int, qtype) -> np.ndarray:
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * columns // block_size, type_size), dtype=np.uint8)
    d_at, m_at = BLOCK_FIELDS[qtype.name]
    blocks[:, d_at:d_at + 2] = (0.0005 + 0.001 * rng.random(len(blocks))).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if m_at is not None:
        blocks[:, m_at:m_at + 2] = (-0.008 * rng.random(len(blocks))).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def main(dest: str, size: str = "7B", type: str = "Q4_0", vocab: Optional[str] = None, seed: int = 0,
         **overrides) -> None:
    import gguf

    from llama.convert.llama2_vocab import VOCAB_GGUF, fetch_llama2_vocab

    if size not in PRESETS:
        raise SystemExit(f"error: unknown size {size!r}; choose one of {', '.join(PRESETS)}")
    if type not in BLOCK_FIELDS and type != "F16":
        raise SystemExit(f"error: --type must be one of {', '.join(BLOCK_FIELDS)} or F16, not {type!r}")
    qtype = gguf.GGMLQuantizationType[type]
    try:
        vocab_path = Path(vocab) if vocab else fetch_llama2_vocab() / VOCAB_GGUF
        reader = gguf.GGUFReader(vocab_path)
        field = lambda key: reader.get_field(key).contents()  # noqa: E731
        tokens = field("tokenizer.ggml.tokens")
        args = model_args(dict(PRESETS[size], **overrides), max_seq_len=4096, max_batch_size=1,
                          tokenizer_vocab=len(tokens))
    except LlamaError as e:
        raise SystemExit(f"error: {e}")

    writer = gguf.GGUFWriter(str(dest), arch="llama")
    writer.add_name(f"random-llama-{size}-{type}")
    writer.add_context_length(4096)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_hidden_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(field("tokenizer.ggml.scores"))
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    writer.add_unk_token_id(field("tokenizer.ggml.unknown_token_id"))

    kv_dim, hidden = args.n_kv_heads * args.head_dim, args.ffn_hidden_dim
    shapes = [("token_embd.weight", (args.vocab_size, args.dim))]
    for i in range(args.n_layers):
        shapes += [(f"blk.{i}.attn_norm.weight", (args.dim,)), (f"blk.{i}.attn_q.weight", (args.dim, args.dim)),
                   (f"blk.{i}.attn_k.weight", (kv_dim, args.dim)), (f"blk.{i}.attn_v.weight", (kv_dim, args.dim)),
                   (f"blk.{i}.attn_output.weight", (args.dim, args.dim)), (f"blk.{i}.ffn_norm.weight", (args.dim,)),
                   (f"blk.{i}.ffn_gate.weight", (hidden, args.dim)), (f"blk.{i}.ffn_up.weight", (hidden, args.dim)),
                   (f"blk.{i}.ffn_down.weight", (args.dim, hidden))]
    shapes += [("output_norm.weight", (args.dim,)), ("output.weight", (args.vocab_size, args.dim))]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    for name, shape in shapes:
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        elif type == "F16":
            writer.add_tensor_info(name, shape, np.dtype(np.float16), shape[0] * shape[1] * 2)
        else:
            rows, cols = shape
            writer.add_tensor_info(name, (rows, cols // block_size * type_size), np.dtype(np.uint8),
                                   rows * cols // block_size * type_size, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    progress = ProgressPrinter()
    for i, (name, shape) in enumerate(shapes):
        if len(shape) == 1:
            array = np.ones(shape, dtype=np.float32)
        elif type == "F16":
            array = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
        else:
            array = random_blocks(rng, *shape, qtype)
        writer.write_tensor_data(array)
        progress("writing random GGUF", i + 1, len(shapes))
    writer.close()
    print(f"wrote {dest}: {args.n_layers} layers of LLaMA {size}'s shape, {type}")


if __name__ == "__main__":
    fire.Fire(main)
