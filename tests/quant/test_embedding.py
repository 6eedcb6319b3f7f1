"""A GGUF's quantized embedding kept in its blocks (llama/quant/embedding.py): the rows a lookup gives are the file's
values bit for bit, so the model computes exactly what it computes with the embedding widened to float, in every
place the embedding is used (eager, the server's batched step, sessions and prompt caches, `compile=True`,
`torchrun`), and the memory check counts its true bytes.

The GGUF files are tiny random models written as llama.cpp lays them out (tests/gguf_writer.py), their embedding
tied to the output layer as the default model's is. "Today's conversion" is the same checkpoint with the embedding
in float32, gguf's own dequantized values, which is what `llama-convert` wrote before.
"""

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_writer import Q, write_llama_gguf
from helpers import build, generate_json
from llama.io.checkpoint import CheckpointReader, expected_shapes, model_args, read_params, save_checkpoint
from llama.convert.gguf import convert_gguf, converted_bytes
from llama.quant.embedding import QuantizedEmbedding
from llama.io.identity import model_identity
from llama.io.prompt_cache import load_prompt_cache, restore, save_prompt_cache
from llama.nn.session import Session
from llama.io.weights import model_bytes, resolve_plan

TYPES = {Q.Q8_0: "int8", Q.Q4_0: "int4", Q.Q4_1: "int4"}
# Where a cached run is compared with an uncached one, the exact paths: these models mix F16 layers with Q8_0 ones,
# and on the integer kernels the float layers' matrix products (whose rounding depends on how many rows they
# multiply) feed the activations' rounding to int8, which amplifies it (by up to 1.5e-2 here, float embedding or not).
EXACT = dict(quant_kernels="exact")
# Widths whose groups of 32 split between two ranks (dim 64: 2 groups; hidden 128: 4), for the torchrun test.
SHAPE = dict(dim=64, hidden=128, n_heads=8, n_kv_heads=2)


def theirs(src: Path) -> torch.Tensor:
    """The GGUF's embedding as `gguf.quants.dequantize` gives it: (vocab, dim) float32."""
    (t,) = [t for t in gguf.GGUFReader(src).tensors if t.name == "token_embd.weight"]
    shape = tuple(int(n) for n in reversed(t.shape))
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)


def with_float_embedding(ckpt: Path, src: Path, dest: Path) -> Path:
    """`ckpt` with its embedding widened to gguf's float32 values, as llama-convert wrote it before: the rest as is."""
    state = dict(torch.load(ckpt / "consolidated.00.pth", weights_only=True))
    for part in ("scales", "mins"):
        state.pop(f"tok_embeddings.{part}", None)
    state["tok_embeddings.weight"] = theirs(src)
    files = {"tokenizer_config.json": (ckpt / "tokenizer_config.json").read_bytes()}
    return save_checkpoint(dest, read_params(ckpt), state, tokenizer_path=ckpt / "tokenizer.model", extra_files=files,
                           quantization_source="test")


@pytest.fixture(scope="module", params=list(TYPES), ids=[t.name for t in TYPES])
def models(request, tmp_path_factory):
    """(GGUF file, its conversion, today's float-embedding conversion) for a tied model whose embedding is of
    each kept type, its layers Q8_0 and F16."""
    root = tmp_path_factory.mktemp(request.param.name)
    src = write_llama_gguf(root / "m.gguf", types={"token_embd": request.param}, tied=True, **SHAPE)
    ckpt = convert_gguf(src, root / "kept")
    return src, ckpt, with_float_embedding(ckpt, src, root / "float")


def test_looked_up_rows_are_the_files_values_bit_for_bit(models):
    """In float32 the very values gguf.quants.dequantize gives; in bf16 and fp16 those values rounded, as a float
    embedding loaded in that dtype holds them. Any shape of ids, repeats and the first and last row included."""
    src, ckpt, _ = models
    expected = theirs(src)
    vocab = expected.shape[0]
    tokens = torch.tensor([[0, 5, vocab - 1, 5, 17, 0, 298], [1, 2, 3, 4, 250, 251, 252]])
    stored = torch.load(ckpt / "consolidated.00.pth", weights_only=True)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = build(ckpt, dtype=dtype).model
        embedding = model.tok_embeddings
        assert isinstance(embedding, QuantizedEmbedding) and embedding.weight.dtype in (torch.int8, torch.uint8)
        assert model.dtype == dtype
        with torch.inference_mode():
            rows = embedding(tokens)
            assert rows.dtype == dtype and torch.equal(rows, expected[tokens].to(dtype))
            assert torch.equal(embedding(torch.arange(vocab)), expected.to(dtype))  # the whole table
        # It holds the file's tensors as they are: its state_dict is the on-disk layout.
        for name, tensor in embedding.state_dict().items():
            assert torch.equal(tensor, stored[f"tok_embeddings.{name}"]), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_equal_todays_float_embedding_conversion_exactly(models, dtype):
    """The same values in: the same logits out, to the last bit, at every position, and the same greedy tokens."""
    _, ckpt, widened = models
    kept, wide = build(ckpt, dtype=dtype), build(widened, dtype=dtype)
    assert not isinstance(wide.model.tok_embeddings, QuantizedEmbedding)
    tokens = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(kept.model(tokens), wide.model(tokens))
    prompts = [[1, 5, 9, 77, 200], [1, 40]]
    assert kept.generate(prompts, 16, temperature=0, ignore_stop=True) == \
        wide.generate(prompts, 16, temperature=0, ignore_stop=True)


def test_cached_and_uncached_logits_agree(models):
    _, ckpt, _ = models
    model = build(ckpt, **EXACT).model
    tokens = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = model(tokens)
        cache = model.new_kv_cache(2, 20)
        steps = [model(tokens[:, :6], 0, cache)] + [model(tokens[:, p:p + 1], p, cache) for p in range(6, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)


def test_the_memory_check_counts_the_embeddings_true_bytes(models):
    """Before loading, the loader's estimate of what the model holds is exactly what the loaded model holds (on the
    exact paths, whose layers hold the on-disk layout): the embedding at its quantized size, not in float32."""
    _, ckpt, widened = models
    held = {}
    for name, path in (("kept", ckpt), ("float", widened)):
        llama = build(path, quant_kernels="exact")
        reader = CheckpointReader(path)
        args = model_args(read_params(path), 64, 8, llama.tokenizer.n_words)
        reader.check(args)
        estimate = model_bytes(expected_shapes(args), resolve_plan(llama.model, reader, None), torch.float32, 1)
        held[name] = sum(t.nbytes for t in llama.model.state_dict().values())
        assert estimate == held[name], name
    vocab, dim = args.vocab_size, args.dim
    assert held["float"] - held["kept"] == vocab * dim * 4 - sum(
        t.nbytes for t in build(ckpt).model.tok_embeddings.state_dict().values())


def test_the_disk_estimate_counts_the_kept_embedding(models):
    """What `-m` says a conversion will take (and checks is free) before it writes: the embedding at its blocks'
    size (in float32 it would be 40% more here)."""
    src, ckpt, _ = models
    written = sum(f.stat().st_size for f in ckpt.iterdir())
    assert written <= converted_bytes(src) <= written * 1.05


def test_a_session_and_a_prompt_cache_answer_as_a_fresh_run(models, tmp_path):
    _, ckpt, widened = models
    llama = build(ckpt, **EXACT)
    session = Session(llama.model)
    llama.generate([[1, 5, 9, 77]], 6, temperature=0, session=session, ignore_stop=True)
    path = save_prompt_cache(tmp_path / "p.kv", session, model_identity(llama), "tiny")
    resumed = Session(build(ckpt, **EXACT).model)
    assert restore(resumed, load_prompt_cache(path, model_identity(llama), llama.model.n_layers)) == len(session.tokens)
    longer = session.tokens + [40, 41, 42]
    got = llama.generate([longer], 10, temperature=0, logprobs=True, session=resumed, ignore_stop=True)
    expected = build(widened, **EXACT).generate([longer], 10, temperature=0, logprobs=True, ignore_stop=True)
    assert got[0] == expected[0] and resumed.last_reused == len(session.tokens)
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(expected[1]), rtol=0, atol=1e-5)


def test_the_servers_batched_steps_answer_as_generate_alone(models):
    """llama-server's loop (rows at their own positions, paged blocks) over the kept embedding gives each prompt
    what the float embedding's `generate` gives it alone."""
    from helpers import make_engine, run_jobs
    from llama.server.engine import Job

    _, ckpt, widened = models
    llama, wide = build(ckpt, max_seq_len=128, **EXACT), build(widened, max_seq_len=128, **EXACT)
    prompts = [[1, 5, 9, 77, 200, 31], [1, 40], [1, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
    engine = make_engine(llama, block_size=4)
    collectors = run_jobs(engine, [Job(p, 12, None, temperature=0) for p in prompts])
    for prompt, collector in zip(prompts, collectors):
        tokens, _ = wide.generate([prompt], 12, temperature=0)
        assert collector.texts() == [wide.tokenizer.decode(tokens[0])]
    engine.drain(5)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
def test_compiled_lookup_and_step_equal_eager(tmp_path):
    """torch.compile'd, the lookup still gives the file's values bit for bit, and the compiled decode step the eager
    logits (1e-5) and greedy tokens. Layers in F16, so that what is compiled beyond the float path is the lookup."""
    layers = {k: Q.F16 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    src = write_llama_gguf(tmp_path / "m.gguf", types={"token_embd": Q.Q4_1, **layers}, tied=True, **SHAPE)
    ckpt = convert_gguf(src, tmp_path / "kept")
    eager, compiled = build(ckpt), build(ckpt, compile=True)
    assert isinstance(compiled.model.tok_embeddings, QuantizedEmbedding)
    tokens = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        lookup = torch.compile(compiled.model.tok_embeddings, fullgraph=True)
        assert torch.equal(lookup(tokens), theirs(src)[tokens])
        full = eager.model(tokens)
        cache = compiled.model.new_kv_cache(1, 32)
        compiled.model(tokens[:, :3], 0, cache)
        for pos in range(3, 24):
            logits = compiled.compiled_step(tokens[:, pos:pos + 1], pos, cache, num_logits=1)
            torch.testing.assert_close(logits[:, 0], full[:, pos], rtol=0, atol=1e-5)
    prompts = [[1, 5, 9, 77, 200]]
    assert compiled.generate(prompts, 20, temperature=0, ignore_stop=True)[0] == \
        eager.generate(prompts, 20, temperature=0, ignore_stop=True)[0]


@pytest.mark.slow
def test_torchrun_splits_the_kept_embedding_by_whole_groups(tmp_path):
    """Two ranks each hold half of every row's groups (Meta splits the embedding's width) and gather the looked-up
    halves: one process's greedy tokens and logprobs (1e-5), cache on and off, on the exact paths."""
    src = write_llama_gguf(tmp_path / "m.gguf", types={"token_embd": Q.Q4_1}, tied=True, **SHAPE)
    ckpt = convert_gguf(src, tmp_path / "kept")
    assert json.loads((ckpt / "quantization.json").read_text())["format_version"] == 2
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a b c\nthe meaning of life\n")
    flags = ("--prompts-file", prompts, "--echo", "--quant-kernels", "exact")
    one = generate_json(ckpt, *flags)
    for extra in ([], ["--no-kv-cache"]):
        two = generate_json(ckpt, *flags, *extra, nproc=2)
        assert len(two) == len(one) == 2
        for a, b in zip(two, one):
            assert a["tokens"] == b["tokens"]
            assert max(abs(p - q) for p, q in zip(a["logprobs"], b["logprobs"], strict=True)) < 1e-5
