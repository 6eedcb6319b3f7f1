"""--compile: the compiled decode step gives what the eager one gives, and compiles once.

Inductor needs a C++ compiler on the CPU; without one these tests skip (as the CUDA tests do without a GPU).
"""

import os
import shutil

import pytest
import torch

from helpers import build, run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler"),
]

PROMPTS = ["I believe the meaning of life is", "def fibonacci(n):", "A"]


@pytest.fixture(scope="module")
def eager(gqa_ckpt):
    return build(gqa_ckpt)


@pytest.fixture(scope="module")
def compiled(gqa_ckpt):
    return build(gqa_ckpt, compile=True)


def _tokens(llama, prompts):
    return [llama.tokenizer.encode(p, bos=True, eos=False) for p in prompts]


def test_compiled_step_logits_equal_eager_at_every_position(eager, compiled):
    tokens = torch.randint(0, eager.model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = eager.model(tokens)  # one uncached eager pass: the reference for every position
        cache = compiled.model.new_kv_cache(1, 48)
        compiled.model(tokens[:, :3], 0, cache)
        for pos in range(3, 40):
            logits = compiled.compiled_step(tokens[:, pos : pos + 1], pos, cache, num_logits=1)
            torch.testing.assert_close(logits[:, 0], full[:, pos], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch-1", "batch-3"])
def test_compiled_generation_equals_eager(eager, compiled, kv_cache, prompts):
    """Greedy tokens identical, logprobs within 1e-5, for one prompt and a batch of different lengths, each
    run to its 40 tokens (ignore_stop) whatever the random model ranks first."""
    prompt_tokens = _tokens(eager, prompts)
    want, want_lp = eager.generate(prompt_tokens, 40, temperature=0, logprobs=True, kv_cache=kv_cache, ignore_stop=True)
    got, got_lp = compiled.generate(prompt_tokens, 40, temperature=0, logprobs=True, kv_cache=kv_cache, ignore_stop=True)
    assert got == want
    assert all(len(t) == 40 for t in got)
    for a, b in zip(got_lp, want_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_later_calls_compile_nothing(compiled):
    """The build compiled the batch-1 cached step for every position and cache length: new prompts and
    lengths must reuse it (each recompilation would cost the user half a minute)."""
    prompts = _tokens(compiled, ["Hello", "A much longer prompt than the one before it, to move positions"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        # A one-token prompt too: its first step, at position 1, would be compiled anew if it were compiled.
        for prompt, n in ((prompts[0], 3), (prompts[1], 30), ([1], 6)):
            (tokens,), _ = compiled.generate([prompt], n, temperature=0, ignore_stop=True)
            assert len(tokens) == n


def test_compile_flag_prints_the_same_text(nonstop_ckpt):
    args = ("llama-generate", "--ckpt-dir", nonstop_ckpt, "--prompt", "The history of", "--temperature", "0",
            "--max-gen-len", "24")
    plain = run(*args)
    result = run(*args, "--compile", "--stats")
    assert plain.returncode == 0 and result.returncode == 0, result.stderr
    assert result.stdout == plain.stdout
    # 24 tokens, all of them (this checkpoint's greedy runs never stop early): the text is not empty.
    assert "generated:       24 tokens" in result.stderr and plain.stdout.strip()
    assert "compiled:        yes, in " in result.stderr


def test_a_missing_compiler_is_a_one_line_error(gqa_ckpt):
    result = run("llama-generate", "--ckpt-dir", gqa_ckpt, "--prompt", "Hi", "--compile",
                 env={"CXX": "/nonexistent/c++", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: --compile failed: ")
    assert "Traceback" not in result.stderr and result.stdout == ""
