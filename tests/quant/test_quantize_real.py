"""Quantization on the default model (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF): lossless where the file
allows it, and sensible text."""

import re

import pytest
import torch

from llama import Llama
from llama.quant import format as qf
from llama.convert.fetch import default_model_dir

from helpers import uncached_in_one_pass

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt_dir():
    return default_model_dir()


def test_requantizing_the_default_models_weights_reproduces_its_gguf_values_exactly(ckpt_dir):
    """Its float weights ARE the GGUF's dequantized blocks: Q4_1 for every projection (int4, group 32) and
    Q8_0 for the tied embedding / output layer (int8, group 32). Quantizing them again must give them back
    bit for bit; so `--quantize int4` is lossless on every layer but the output, which int4 rounds."""
    state = torch.load(ckpt_dir / "consolidated.00.pth", mmap=True, weights_only=True)
    checked = 0
    for name, w in state.items():
        if not qf.is_linear_weight(name):
            continue
        if name == "output.weight":
            q, s = qf.quantize_int8(w, 32)
            assert torch.equal(qf.dequantize(q, s), w.float())
            p, s, m = qf.quantize_int4(w, 32)
            assert not torch.equal(qf.dequantize(p, s, m), w.float())  # Q8_0 values do not fit in 4 bits
        else:
            p, s, m = qf.quantize_int4(w, 32)
            assert torch.equal(qf.dequantize(p, s, m), w.float()), name
        checked += 1
    assert checked == 30 * 7 + 1


@pytest.mark.parametrize("method,dtype", [("int8", "bfloat16"), ("int4", "bfloat16"), ("int4", "float32")])
def test_quantized_greedy_text_stays_sensible(ckpt_dir, method, dtype):
    llama = Llama.build(ckpt_dir, max_seq_len=64, max_batch_size=2, device="cpu", dtype=dtype, quantize=method)
    out = llama.text_completion(["The capital of France is", "def fibonacci(n):"], temperature=0, max_gen_len=12)
    assert "Paris" in out[0]["generation"]
    # The float model writes "\n    if n == 0:\n        return 1"; int4 rounds its way to "n == 1": either way, a
    # base case in Python, indented as Python is.
    assert re.match(r"\n    if n (==|<=|<) \d:\n        return ", out[1]["generation"]), out[1]["generation"]


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a village of 1,024 people,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def transformers_tokens():
    """transformers' 32 greedy tokens after each prompt, from the same GGUF file, stop tokens ignored."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file
    from llama.convert.fetch import default_model_gguf

    path = default_model_gguf()
    model = transformers.LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run on through end-of-turn tokens, as ignore_stop does
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    out = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            generated = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0)
            out[prompt] = (ids, generated[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def file_quantized(tmp_path_factory):
    """The default model's GGUF converted keeping its blocks: Q4_1 projections as int4, the Q8_0 embedding and output
    layer as int8."""
    from llama.convert.gguf import convert_gguf
    from llama.convert.fetch import default_model_gguf

    ckpt = convert_gguf(default_model_gguf(), tmp_path_factory.mktemp("q") / "smollm2-q4_1")
    # On the exact paths, whose claim these tests check (the integer kernels round activations too).
    return Llama.build(ckpt, max_seq_len=128, max_batch_size=1, device="cpu", dtype="float32", quant_kernels="exact")


def test_the_models_own_quantized_blocks_give_the_float_models_logits(ckpt_dir, file_quantized):
    """Held as int4/int8 they are the very values the float checkpoint holds widened (measured: logits equal to
    the last bit, both widening to the same float32 values; 2e-5 allows another order of additions)."""
    assert file_quantized.info.quantization == "mixed, embedding int8-g32"
    widened = Llama.build(ckpt_dir, max_seq_len=128, max_batch_size=1, device="cpu", dtype="float32")
    ids = torch.tensor([widened.tokenizer.encode(PROMPTS[2], bos=True, eos=False)])
    with torch.inference_mode():
        got, want = file_quantized.model(ids), widened.model(ids)
    assert want.abs().max() > 5
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_int4_greedy_text_agrees_with_transformers_for_32_tokens(file_quantized, transformers_tokens, prompt):
    """Run in float32 (exact, see test_quantize.py), the model held in its file's own int4 blocks continues each
    prompt as transformers does on the same GGUF: after the prompt and each of transformers' greedy tokens, its most
    likely next token is transformers' next (one pass over them all, where generating would dequantize every layer
    again at each of 32 steps). (`--quantize int4` also rounds the output layer, which the file holds as Q8_0, to
    int4: its text is checked for sense in test_quantized_greedy_text_stays_sensible.)"""
    ids, theirs = transformers_tokens[prompt]
    assert file_quantized.tokenizer.encode(prompt, bos=True, eos=False) == ids
    with torch.inference_mode():
        logits = file_quantized.model(torch.tensor([ids + theirs[:-1]]), 0)[0, len(ids) - 1:]
    assert len(theirs) == 32 and logits.argmax(-1).tolist() == theirs


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_on_the_integer_kernels_cached_and_uncached_give_the_same_bits(ckpt_dir, method):
    """30 layers deep, rounding activations to 8 bits would turn any difference between a cached step and an
    uncached pass into a different text within a few tokens; the integer kernels and row-exact attention leave
    none (test_int_kernels.py). Here the eager cached steps, four rows at once, as a first run takes them while its
    compiled step is built (test_switch_exact.py holds the uncached generation on these weights, and the stored
    step); the uncached side is `uncached_in_one_pass`."""
    llama = Llama.build(ckpt_dir, max_seq_len=96, max_batch_size=4, device="cpu", dtype="float32", quantize=method)
    assert llama.info.quant_kernels == "integer" and llama.compiled_step is None
    ids = [llama.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    cached, lp_cached = llama.generate(ids, 24, temperature=0, logprobs=True, ignore_stop=True)
    for prompt, tokens, logprobs, (argmax, lp_uncached) in zip(PROMPTS, cached, lp_cached,
                                                                 uncached_in_one_pass(llama, ids, cached)):
        assert argmax == tokens, prompt
        assert torch.equal(torch.tensor(logprobs, dtype=torch.float64), lp_uncached), prompt
