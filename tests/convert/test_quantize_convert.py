"""Quantized checkpoints on disk: GGUF blocks kept without loss, k-quants mapped to the nearest format,
`llama-convert --quantize` of float sources, the quantization record, and the errors."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llama.quant import format as quant_format
from llama.convert.gguf import convert_gguf
from llama.convert.gguf_quant import keep_quantized

from gguf_writer import Q, random_blocks, write_llama_gguf
from helpers import EXAMPLE_TOKENIZER, build, convert_cli, write_tiny

LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")
GGUF_NAMES = {"attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
              "attention.wo": "attn_output", "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up",
              "feed_forward.w2": "ffn_down"}
# A shape whose rows are whole k-quant super-blocks of 256.
K_SHAPE = dict(dim=256, hidden=512, n_heads=4, n_kv_heads=2)


def load(ckpt: Path):
    return torch.load(ckpt / "consolidated.00.pth", weights_only=True)


def gguf_tensors(path: Path):
    """GGUF name -> (type, raw data, (out, in) shape)."""
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type, t.data, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}


def gguf_name(meta_name: str) -> str:
    if meta_name in ("output.weight", "tok_embeddings.weight"):
        return {"output.weight": "output.weight", "tok_embeddings.weight": "token_embd.weight"}[meta_name]
    _, layer, block, proj, _ = meta_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES[f'{block}.{proj}']}.weight"


def ours_dequantized(state_dict, name: str) -> torch.Tensor:
    prefix = name.removesuffix(".weight")
    return quant_format.dequantize(state_dict[name], state_dict[f"{prefix}.scales"], state_dict.get(f"{prefix}.mins"))


def theirs_dequantized(raw, qtype, shape) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).reshape(shape)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_q8_0_q4_0_q4_1_are_kept_without_any_loss(tmp_path, qtype):
    src = write_llama_gguf(tmp_path / "m.gguf", types={k: qtype for k in LINEAR_KINDS + ("token_embd",)})
    ckpt = convert_gguf(src, tmp_path / "ckpt")
    sd, raw = load(ckpt), gguf_tensors(src)
    linear = [n for n in sd if quant_format.is_linear_weight(n)]
    assert len(linear) == 2 * 7 + 1
    expected_method = "int8" if qtype == Q.Q8_0 else "int4"
    for name in linear + ["tok_embeddings.weight"]:  # the embedding's blocks are kept too (llama/quant/embedding.py)
        assert quant_format.method_of(sd, name) == expected_method, name
        assert sd[f"{name.removesuffix('.weight')}.scales"].dtype == torch.float16
        t_type, data, shape = raw[gguf_name(name)]
        diff = (ours_dequantized(sd, name) - theirs_dequantized(data, t_type, shape)).abs().max().item()
        assert diff == 0, (name, diff)
    record = json.loads((ckpt / quant_format.RECORD_NAME).read_text())
    assert (record["format_version"], record["method"], record["group_size"]) == (2, expected_method, 32)
    assert sd["norm.weight"].dtype == torch.float32


@pytest.mark.parametrize("qtype, method, group, tolerance", [
    # Scales (and mins) are products of a float16 and a small integer, rounded to float16: 2^-11 relative.
    (Q.Q6_K, "int8", 16, 2.0 ** -11),
    (Q.Q4_K, "int4", 32, 2.0 ** -11),
])
def test_k_quants_become_the_nearest_format_with_rounded_scales(qtype, method, group, tolerance):
    rows, cols = 8, 512
    raw = random_blocks(rows, cols, qtype, seed=1)
    kept = keep_quantized(qtype.name, raw, (rows, cols), dequantize=None)
    assert kept["scales"].shape == (rows, cols // group) and kept["scales"].dtype == torch.float16
    assert ("mins" in kept) == (method == "int4")
    ours = quant_format.dequantize(kept["weight"], kept["scales"], kept.get("mins"))
    theirs = theirs_dequantized(raw, qtype, (rows, cols))
    if method == "int8":
        q = kept["weight"].float()
        assert q.min() >= -32 and q.max() <= 31  # 6-bit values, centred
        bound = theirs.abs() * tolerance
    else:
        # w = s q + m: each term carries its own rounding.
        q = quant_format.unpack_int4(kept["weight"]).float()
        mins = kept["mins"].float().repeat_interleave(group, dim=1)
        bound = ((theirs - mins).abs() + mins.abs()) * tolerance
    error = (ours - theirs).abs()
    assert (error <= bound + 1e-12).all(), (error - bound).max()
    assert error.max() > 0  # not exact: the product of two scales is rounded (said in the docs)


def test_q5_k_is_quantized_again_to_int8_within_half_a_step():
    rows, cols = 8, 512
    raw = random_blocks(rows, cols, Q.Q5_K, seed=2)
    theirs = theirs_dequantized(raw, Q.Q5_K, (rows, cols))
    kept = keep_quantized("Q5_K", raw, (rows, cols), dequantize=lambda: theirs)
    assert kept["weight"].dtype == torch.int8 and kept["scales"].shape == (rows, cols // 32)
    ours = quant_format.dequantize(kept["weight"], kept["scales"])
    half_step = kept["scales"].float().repeat_interleave(32, dim=1) / 2
    assert ((ours - theirs).abs() <= half_step * (1 + 1e-3)).all()


def test_a_k_quant_gguf_converts_saying_what_became_of_each_type(tmp_path):
    types = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K,
             "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K, "token_embd": Q.Q4_K}
    src = write_llama_gguf(tmp_path / "m.gguf", types=types, **K_SHAPE)
    notices = []
    ckpt = convert_gguf(src, tmp_path / "ckpt", notice=notices.append)
    sd = load(ckpt)
    assert quant_format.method_of(sd, "layers.0.attention.wq.weight") == "int4"
    assert quant_format.method_of(sd, "layers.0.attention.wv.weight") == "int8"
    assert sd["layers.0.attention.wv.scales"].shape == (128, 256 // 16)
    assert sd["layers.0.feed_forward.w3.scales"].shape == (512, 256 // 32)
    assert sd["tok_embeddings.weight"].dtype == torch.float32
    assert json.loads((ckpt / quant_format.RECORD_NAME).read_text())["method"] == "mixed"
    assert sorted(notices) == sorted([
        "8 Q4_K tensors: kept as int4, group 32 (its two levels of scales and mins multiplied into float16)",
        "1 Q4_K tensor: dequantized to float32",
        "5 Q6_K tensors: kept as int8, group 16 (its two levels of scales multiplied into one float16 scale)",
        "2 Q5_K tensors: requantized to int8, group 32 (its 5-bit values with a minimum fit neither format)",
    ])


def test_float_and_dequantized_conversions_stay_float(tmp_path):
    src = write_llama_gguf(tmp_path / "m.gguf")  # Q8_0 and F16 mixed
    wide = convert_gguf(src, tmp_path / "wide", dequantize=True)
    assert not (wide / quant_format.RECORD_NAME).exists()
    assert all(not name.endswith(".scales") for name in load(wide))
    f16 = write_llama_gguf(tmp_path / "f16.gguf", types={k: Q.F16 for k in LINEAR_KINDS + ("token_embd",)})
    sd = load(convert_gguf(f16, tmp_path / "f16"))
    assert sd["layers.0.attention.wq.weight"].dtype == torch.float16


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_a_float_checkpoint_within_half_a_step(tmp_path, method):
    src, float_sd = write_tiny(tmp_path / "float", num_shards=2)
    done = convert_cli(src, tmp_path / "q", "--quantize", method)
    assert done.returncode == 0, done.stderr
    ckpt = tmp_path / "q"
    sd = load(ckpt)
    record = quant_format.read_record(ckpt)
    assert record["method"] == method and record["group_size"] == (None if method == "int8" else 32)
    for name, w in float_sd.items():
        if not quant_format.is_linear_weight(name):
            assert torch.equal(sd[name], w), name
            continue
        assert quant_format.method_of(sd, name) == ("int8" if name == "output.weight" else method)  # int4 keeps it
        scales = sd[f"{name.removesuffix('.weight')}.scales"].float()
        step = scales.repeat_interleave(w.shape[1] // scales.shape[1], dim=1)
        error = (ours_dequantized(sd, name) - w).abs()
        # Half a step, plus float16's rounding of the min for int4.
        assert (error <= step / 2 + 1e-3 * w.abs().max()).all(), name
    assert (ckpt / "tokenizer.model").read_bytes() == EXAMPLE_TOKENIZER.read_bytes()
    again = convert_cli(ckpt, tmp_path / "again", "--quantize", method)
    assert again.returncode == 1 and "already quantized" in again.stderr and not (tmp_path / "again").exists()


def test_quantize_a_gguf_requantizes_only_what_is_not_in_that_method(tmp_path):
    src = write_llama_gguf(tmp_path / "m.gguf")  # Q8_0 and F16 linear weights
    ckpt = convert_gguf(src, tmp_path / "q", quantize="int8")
    sd = load(ckpt)
    assert sd["layers.0.attention.wq.scales"].shape[1] == 64 // 32  # Q8_0 kept, group 32
    assert sd["layers.0.attention.wv.scales"].shape[1] == 1  # F16 quantized per output channel
    sd4 = load(convert_gguf(src, tmp_path / "q4", quantize="int4"))
    assert all(quant_format.method_of(sd4, n) == "int4" for n in sd4 if quant_format.is_linear_weight(n))


@pytest.mark.slow
def test_errors_are_one_line_and_leave_nothing(tmp_path):
    src, _ = write_tiny(tmp_path / "float")
    bad = convert_cli(src, tmp_path / "q", "--quantize", "int3")
    assert bad.returncode == 1 and bad.stderr.strip() == "error: unknown quantization 'int3'; choose one of int8, int4 (or leave it out for float)"
    plain = convert_cli(src, tmp_path / "q")
    assert plain.returncode == 1 and "pass --quantize int8 or int4" in plain.stderr
    assert len(plain.stderr.strip().splitlines()) == 1
    # A GGUF type the gguf package cannot read (Q8_1) can be neither kept nor widened.
    gguf_src = write_llama_gguf(tmp_path / "q8_1.gguf", types={"ffn_up": Q.Q8_1})
    failed = convert_cli(gguf_src, tmp_path / "g")
    assert failed.returncode == 1 and "Q8_1" in failed.stderr and "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1].startswith("error: ")
    assert not (tmp_path / "q").exists() and not (tmp_path / "g").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["float", "q8_1.gguf"]  # no temporary directory left


def test_quantized_checkpoint_shards_and_loads_weights_only(tmp_path):
    from llama.io.checkpoint import save_checkpoint
    from llama.convert.quantize_checkpoint import quantize_state_dict

    src, float_sd = write_tiny(tmp_path / "float")
    quantized = quantize_state_dict(float_sd, "int4")
    params = json.loads((src / "params.json").read_text())
    ckpt = save_checkpoint(tmp_path / "q2", params, quantized, num_shards=2, quantization_source="test")
    shards = [torch.load(ckpt / f"consolidated.{i:02d}.pth", weights_only=True) for i in range(2)]
    # Column-parallel layers split their rows, row-parallel ones their (packed) columns, scales with them.
    assert shards[0]["layers.0.attention.wq.weight"].shape == (32, 32)
    assert shards[0]["layers.0.attention.wo.weight"].shape == (64, 16)
    assert shards[0]["layers.0.attention.wo.scales"].shape == (64, 1)
    assert json.loads((ckpt / quant_format.RECORD_NAME).read_text())["source"] == "test"


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_converted_quantized_gguf_generates_like_its_float_conversion(tmp_path, qtype):
    """Kept as int4 / int8 blocks, the model computes what its dequantized conversion computes: the same float32
    values (equal to the last bit today, both widening the weight for F.linear; 2e-5 allows a kernel's other
    order of additions), and so greedy runs give the same tokens."""
    src = write_llama_gguf(tmp_path / "m.gguf", types={k: qtype for k in LINEAR_KINDS})
    # The exact paths multiply by the very weights the float conversion holds; the integer kernels round the
    # activations too, which moves this flat random model's logits by ~1.6%, more than its top two tokens' gap.
    kept = build(convert_gguf(src, tmp_path / "kept"), quant_kernels="exact")
    wide = build(convert_gguf(src, tmp_path / "wide", dequantize=True))
    tokens = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))  # its 300-piece vocabulary
    with torch.inference_mode():
        torch.testing.assert_close(kept.model(tokens), wide.model(tokens), rtol=0, atol=2e-5)
    prompt = [[1, 5, 9, 77, 200]]
    ours, _ = kept.generate(prompt, max_gen_len=16, temperature=0, ignore_stop=True)
    reference, _ = wide.generate(prompt, max_gen_len=16, temperature=0, ignore_stop=True)
    assert ours == reference


def test_quantize_a_hugging_face_directory_memory_mapped(tmp_path):
    from llama.convert.hf import convert_hf
    from helpers import save_hf, tiny_hf_model

    src = save_hf(tiny_hf_model(tied=True), tmp_path / "hf")
    wide = load(convert_hf(src, tmp_path / "wide"))
    sd = load(convert_hf(src, tmp_path / "q", quantize="int4"))
    # The feed-forward width, 200, is not a multiple of 32: w2 gets groups of 8 and the record says "mixed".
    assert sd["layers.0.feed_forward.w2.scales"].shape == (64, 200 // 8)
    assert quant_format.read_record(tmp_path / "q")["method"] == "mixed"
    for name, w in wide.items():
        if quant_format.is_linear_weight(name):
            scales = sd[f"{name.removesuffix('.weight')}.scales"].float()
            step = scales.repeat_interleave(w.shape[1] // scales.shape[1], dim=1)
            assert ((ours_dequantized(sd, name) - w).abs() <= step / 2 + 1e-3 * w.abs().max()).all(), name
        else:
            assert torch.equal(sd[name], w), name


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    """The default model's own GGUF file (Q4_1 projections, a Q8_0 embedding), fetched on first use: this test
    runs, alone or with -k, whether or not another test fetched it before."""
    from llama.convert.fetch import default_model_gguf

    return default_model_gguf()


@pytest.mark.slow
def test_the_default_model_converts_to_int4_equal_to_its_own_file(default_gguf, tmp_path):
    src = default_gguf
    ckpt = convert_gguf(src, tmp_path / "int4")
    sd, raw = load(ckpt), gguf_tensors(src)
    linear = [n for n in sd if quant_format.is_linear_weight(n)]
    assert sum(quant_format.method_of(sd, n) == "int4" for n in linear) == len(linear) - 1  # all but the output
    assert quant_format.method_of(sd, "tok_embeddings.weight") == "int8"
    for name in linear + ["tok_embeddings.weight"]:
        # The output layer is the tied Q8_0 embedding, kept as int8 as the embedding itself is.
        t_type, data, shape = raw["token_embd.weight" if name == "output.weight" else gguf_name(name)]
        assert torch.equal(ours_dequantized(sd, name), theirs_dequantized(data, t_type, shape)), name
