"""Quantized models (--quantize int8|int4, or a checkpoint stored quantized): the cache switch stays exact, a
quantized model computes what a float model holding its stored values computes (dequantized without the
library, helpers.dequantize_stored), bf16 stays within bf16's tolerance of that, --compile agrees with the
eager model, and the state dict is the on-disk layout. One layer at a time: test_quantize_layers.py.

Every model here is built with quant_kernels="exact", whose claims these are: on the CPU the default is the integer
kernels, which round activations too and are tested against their own reference in test_int_kernels.py.
"""

import os
import shutil

import pytest
import torch
from torch import nn

import helpers
from helpers import EXAMPLE_TOKENIZER, dequantize_stored, tiny_args, without_kernels, write_tiny
from llama.quant import format as qf
from llama.io.checkpoint import save_checkpoint
from llama.errors import LlamaError
from llama.generation import Llama
from llama.quant.linears import (
    HAS_INT4_KERNEL, HAS_INT8_KERNEL, Int4HalvesLinear, Int4KernelLinear, Int4Linear, Int8KernelLinear, Int8Linear,
)
from llama.quant.quantize import quantize_model, slow_path_note
from llama.io.random_weights import random_state_dict

METHODS = ["int8", "int4"]


def build(ckpt, **kwargs) -> Llama:
    return helpers.build(ckpt, quant_kernels="exact", **kwargs)


needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                    reason="--compile needs a C++ compiler")


@pytest.fixture(scope="module")
def quantized(tiny_ckpt):
    return {m: build(tiny_ckpt, quantize=m) for m in METHODS}


def float_model_of(llama, ckpt):
    """The float32 model of `ckpt` with each quantized layer of `llama` replaced by the weight its state dict
    stores, dequantized here rather than by the layer."""
    reference = build(ckpt).model
    state = llama.model.state_dict()
    with torch.no_grad():
        for key in state:
            if key.endswith(".scales"):
                prefix = key.removesuffix("scales")
                reference.get_parameter(prefix + "weight").copy_(dequantize_stored(state, prefix))
    return reference


@pytest.mark.parametrize("method", METHODS)
def test_every_linear_layer_is_quantized_and_the_embedding_is_not(quantized, method):
    model = quantized[method].model
    kind = Int8Linear if method == "int8" else Int4Linear
    assert not any(type(m) is nn.Linear for m in model.modules())
    # int4 keeps the output layer at int8 (per output channel), as llama.cpp keeps it above 4 bits.
    assert isinstance(model.output, Int8Linear) and model.output.group_size is None
    assert isinstance(model.layers[1].feed_forward.w2, kind)
    assert model.tok_embeddings.weight.dtype == torch.float32
    assert quantized[method].info.quantization == {"int8": "int8", "int4": "int4-g32, output int8"}[method]


def test_a_slow_quantized_run_says_what_would_be_fast(quantized, quantized_bf16):
    (note,) = quantized["int4"].info.notes  # float32, eager: exact but slow
    assert "compile=True runs them fast and exact" in note and "dtype=bfloat16" in note
    assert quantized_bf16["int4"].info.notes == []


@pytest.mark.parametrize("method, kernels", [("int8", True), ("int8", False), ("int4", True)],
                         ids=["int8", "int8-no-kernels", "int4"])
def test_cache_switch_is_exact(quantized, method, kernels):
    """Logits at every position within 1e-5, the same greedy tokens and logprobs within 1e-5, with torch's
    private kernels and without them (the dequantize-and-multiply fallback a torch without them runs; in
    float32 only int8 has a kernel path, for decoding's few rows: int4 always widens its weight)."""
    llama = quantized[method] if kernels else without_kernels(quantized[method])
    tokens = torch.randint(0, llama.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    prompts = [[1, 50, 7, 99], [1, 3000]]
    with torch.inference_mode():
        full = llama.model(tokens)  # no cache: every position at once
        cache = llama.model.new_kv_cache(2, 24)
        steps = [llama.model(tokens[:, :8], 0, cache)] + [llama.model(tokens[:, i:i + 1], i, cache) for i in range(8, 24)]
    cached, lp_cached = llama.generate(prompts, 12, temperature=0, logprobs=True, kv_cache=True, ignore_stop=True)
    uncached, lp_uncached = llama.generate(prompts, 12, temperature=0, logprobs=True, kv_cache=False,
                                           ignore_stop=True)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert cached == uncached
    for a, b in zip(lp_cached, lp_uncached):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_matches_a_float_model_holding_the_dequantized_weights(quantized, tiny_ckpt, method):
    """A prompt of 16 positions (16 or 32 rows: every layer widens its weight), then one position a step for
    batches of 1 to 4 (the rows torch's int8 kernel takes in float32). Both models multiply by the same float32
    values, only in another order: measured within 3.4e-6 on logits of magnitude ~4; 2e-5 fails a weight off by
    far less than a quantization step."""
    llama = quantized[method]
    model, reference = llama.model, float_model_of(llama, tiny_ckpt)
    for bsz in (1, 2, 3, 4):
        tokens = torch.randint(0, model.vocab_size, (bsz, 20), generator=torch.Generator().manual_seed(bsz))
        with torch.inference_mode():
            want = reference(tokens)
            cache = model.new_kv_cache(bsz, 20)
            got = torch.cat([model(tokens[:, :16], 0, cache)] +
                            [model(tokens[:, p:p + 1], p, cache) for p in range(16, 20)], dim=1)
        assert want.abs().max() > 1  # the comparison is not between two near-zero tensors
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


@pytest.fixture(scope="module")
def quantized_bf16(gqa_ckpt):
    return {m: build(gqa_ckpt, quantize=m, dtype="bfloat16") for m in METHODS}


@pytest.mark.parametrize("method", METHODS)
def test_bf16_kernels_match_the_float32_model_of_the_same_weights(quantized_bf16, gqa_ckpt, method):
    """In bf16 the kernels (or their fallback) round activations and scales to 8 significant bits (relative
    error 2^-9 each, compounding over the layers): logits agree with float32 to about 2% of their spread,
    the bar STYLE.md sets for any bf16 run."""
    model = quantized_bf16[method].model
    reference = float_model_of(quantized_bf16[method], gqa_ckpt)
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got, want = model(tokens), reference(tokens)
        fallback = without_kernels(quantized_bf16[method]).model(tokens)
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    assert ((fallback - want).norm() / want.norm()).item() < 2e-2


def test_the_slow_path_note_names_only_what_applies(monkeypatch):
    import llama.quant.quantize as quantize

    plan = {"output.weight": ("int4", 32)}
    assert "compile=True" in slow_path_note(plan) and "compile=True" not in slow_path_note(plan, world_size=2)
    monkeypatch.setattr(quantize, "HAS_INT4_KERNEL", False)  # a torch without the int4 kernel
    assert "dtype=bfloat16" not in slow_path_note(plan) and "dtype=bfloat16" in slow_path_note({"x": ("int8", None)})
    assert slow_path_note(plan, world_size=2) == "quantized layers in float32 run eagerly on exact but slow paths"


def test_odd_int4_groups_are_refused_in_one_line(gqa_ckpt):
    with pytest.raises(LlamaError, match="a group of 5 columns is odd"):
        quantize_model(build(gqa_ckpt).model, "int4", group_size=5)


@pytest.mark.parametrize("method", METHODS)
def test_state_dict_is_the_on_disk_layout_and_round_trips(quantized, method, tmp_path):
    llama = quantized[method]
    state = llama.model.state_dict()
    float_shapes = {k: v.shape for k, v in random_state_dict(llama.model.params).items()}
    group = {"int8": None, "int4": 32}[method]
    plan = {k: (method, group or s[1]) for k, s in float_shapes.items() if qf.is_linear_weight(k)}
    plan["output.weight"] = ("int8", float_shapes["output.weight"][1])  # int4 keeps the output layer at int8
    assert {k: v.shape for k, v in state.items()} == qf.quantized_shapes(float_shapes, plan)
    for name, (m, _) in plan.items():
        assert state[name].dtype == (torch.int8 if m == "int8" else torch.uint8)
        assert state[name.replace(".weight", ".scales")].dtype == torch.float16

    params = {k: getattr(llama.model.params, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                                          "multiple_of", "norm_eps")}
    record = qf.write_record(method, group, "test")
    save_checkpoint(tmp_path / "q", params, state, tokenizer_path=EXAMPLE_TOKENIZER,
                    extra_files={qf.RECORD_NAME: record})
    loaded = build(tmp_path / "q")  # no --quantize: the checkpoint says what it holds
    assert loaded.info.quantization == llama.info.quantization
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    prompt = [[1, 20, 30, 40]]
    assert loaded.generate(prompt, 12, temperature=0) == llama.generate(prompt, 12, temperature=0)

    with pytest.raises(LlamaError, match="would round its weights a second time"):
        build(tmp_path / "q", quantize="int4" if method == "int8" else "int8")
    assert build(tmp_path / "q", quantize=method).info.quantization == llama.info.quantization


def test_a_quantized_checkpoint_with_wrong_scales_is_refused(quantized, tmp_path):
    state = dict(quantized["int4"].model.state_dict())
    state["layers.0.attention.wq.scales"] = state["layers.0.attention.wq.scales"][:, :1].contiguous()
    params = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 4000, "multiple_of": 32}
    save_checkpoint(tmp_path / "bad", params, state, tokenizer_path=EXAMPLE_TOKENIZER,
                    extra_files={qf.RECORD_NAME: qf.write_record("int4", 32, "test")})
    with pytest.raises(LlamaError, match="layers.0.attention.wq"):
        build(tmp_path / "bad")


def test_quantized_tensors_without_a_record_are_refused(quantized, tmp_path):
    params = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 4000, "multiple_of": 32}
    path = save_checkpoint(tmp_path / "norecord", params, quantized["int8"].model.state_dict(), tokenizer_path=EXAMPLE_TOKENIZER)
    (path / "quantization.json").unlink()  # save_checkpoint records what it writes; a hand-made copy may not
    with pytest.raises(LlamaError, match="no quantization.json"):
        build(tmp_path / "norecord")


@pytest.mark.parametrize("value", ["int3", "INT8", 8, "fp8"])
def test_unknown_method_is_one_line_listing_the_choices(gqa_ckpt, value):
    with pytest.raises(LlamaError, match=r"choose one of int8, int4"):
        build(gqa_ckpt, quantize=value)


def test_grouped_int8_as_stored_by_gguf_q8_0(tmp_path):
    """Q8_0 blocks are int8 in groups of 32: a checkpoint holding them loads and matches its dequantized weights."""
    args = tiny_args("gqa")
    path, float_state = write_tiny(tmp_path / "f", "gqa", seed=4)
    reference = build(path)
    state = {}
    for name, tensor in float_state.items():
        if qf.is_linear_weight(name):
            q, s = qf.quantize_int8(tensor, 32)
            state[name], state[name.replace(".weight", ".scales")] = q, s
            float_state[name] = dequantize_stored({"weight": q, "scales": s}, "")
        else:
            state[name] = tensor
    params = {"dim": args.dim, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 4000, "multiple_of": 32}
    save_checkpoint(tmp_path / "q8_0", params, state, tokenizer_path=EXAMPLE_TOKENIZER,
                    extra_files={qf.RECORD_NAME: qf.write_record("int8", 32, "gguf Q8_0")})
    save_checkpoint(tmp_path / "deq", params, float_state, tokenizer_path=EXAMPLE_TOKENIZER)
    grouped, dequantized = build(tmp_path / "q8_0"), build(tmp_path / "deq")
    assert grouped.info.quantization == "int8-g32" and reference.info.quantization is None
    tokens = torch.randint(0, 4000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        # Measured: equal to the last bit (both widen to the same float32 values); 2e-5 allows another order.
        torch.testing.assert_close(grouped.model(tokens), dequantized.model(tokens), rtol=0, atol=2e-5)


def test_quantize_model_on_a_built_float_model_matches_quantizing_while_loading(gqa_ckpt):
    loaded = build(gqa_ckpt, quantize="int4")
    model = quantize_model(build(gqa_ckpt).model, "int4", quant_kernels="exact")
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("method", METHODS)
def test_compiled_quantized_step_keeps_the_cache_switch_exact(gqa_ckpt, method):
    """--compile fuses the dequantization into the reduction; it must agree with the exact eager path."""
    compiled = build(gqa_ckpt, quantize=method, compile=True)
    assert compiled.info.notes == []  # the fast exact path: nothing to warn of
    # One prompt: the batch-1 package compile=True stored (another batch size is another package to build, and
    # tests/compile/test_compile.py holds batches of several lengths).
    prompts = [[1, 50, 7, 99, 12]]
    cached, lp_cached = compiled.generate(prompts, 12, temperature=0, logprobs=True, kv_cache=True)
    uncached, lp_uncached = compiled.generate(prompts, 12, temperature=0, logprobs=True, kv_cache=False)
    assert cached == uncached
    for a, b in zip(lp_cached, lp_uncached):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    exact = without_kernels(build(gqa_ckpt, quantize=method))
    eager, lp_eager = exact.generate(prompts, 12, temperature=0, logprobs=True)
    assert cached == eager
    for a, b in zip(lp_cached, lp_eager):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("method", METHODS)
def test_compiled_bf16_step_calls_the_kernels_and_stays_within_bf16_of_float32(gqa_ckpt, method):
    """In bf16 on the CPU the compiled step multiplies with torch's kernels, as the eager one does; its logits
    stay within bf16's tolerance of the float32 model of the same weights."""
    compiled = build(gqa_ckpt, quantize=method, compile=True, dtype="bfloat16")
    layer = compiled.model.layers[0].feed_forward.w1
    if method == "int4":
        assert type(layer) is (Int4KernelLinear if HAS_INT4_KERNEL else Int4HalvesLinear)
    else:
        assert type(layer) is (Int8KernelLinear if HAS_INT8_KERNEL else Int8Linear)
    reference = float_model_of(compiled, gqa_ckpt)
    tokens = torch.randint(0, reference.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = reference(tokens)
        cache = compiled.model.new_kv_cache(1, 24)
        steps = [compiled.model(tokens[:, :4], 0, cache)[:, -1:]]
        steps += [compiled.compiled_step(tokens[:, i:i + 1], i, cache, num_logits=1) for i in range(4, 20)]
    got = torch.cat(steps, dim=1).float()
    assert ((got - want[:, 3:]).norm() / want[:, 3:].norm()).item() < 2e-2


def test_loading_and_converting_group_a_width_32_does_not_divide_alike(tmp_path):
    """A feed-forward width of 200 is not a multiple of 32: w2 gets groups of 8 (the largest that divides it),
    whether the model is quantized while loading or by llama-convert --quantize, and the two hold the same
    tensors."""
    from llama.convert.quantize_checkpoint import convert_meta

    ckpt, _ = write_tiny(tmp_path / "wide", hidden_dim=200)
    loaded = build(ckpt, quantize="int4")
    assert loaded.info.quantization == "mixed"
    assert loaded.model.layers[0].feed_forward.w2.group_size == 8
    assert loaded.model.layers[0].feed_forward.w1.group_size == 32
    converted = build(convert_meta(ckpt, tmp_path / "q", "int4"))
    assert converted.info.quantization == "mixed"
    state = converted.model.state_dict()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_an_odd_width_cannot_be_int4_and_says_what_can(tmp_path):
    ckpt, _ = write_tiny(tmp_path / "odd", hidden_dim=199)
    with pytest.raises(LlamaError, match="has 199 input columns; use quantize=int8"):
        build(ckpt, quantize="int4")
