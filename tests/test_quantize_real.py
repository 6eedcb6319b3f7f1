"""Quantization on the default model (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF): lossless where the file
allows it, and sensible text."""

import pytest
import torch

from llama import Llama
from llama import quant_format as qf
from llama.download import default_model_dir

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
    assert "return" in out[1]["generation"] or "fib" in out[1]["generation"] or "if" in out[1]["generation"]
