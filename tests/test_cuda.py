"""The same promises on a CUDA GPU: the cache changes speed, never the answer.

Every test here is marked `cuda` and skips on a machine without a GPU (CI has none); run them with
`python -m pytest -m cuda` where there is one. TF32 matrix products are off by default in PyTorch, so float32
on the GPU is held to nearly the CPU's tolerances.
"""

import os
import subprocess

import pytest
import torch

from helpers import REPO, TORCHRUN, build, generate, make_engine, prompts, run_jobs, solo
from llama.server.engine import Job

# The default device again for the commands run here, which conftest.py sets to the CPU for the other tests.
ON_THE_GPU = {"LLAMA_DEVICE": ""}

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def tokens_for(model, batch=3, length=40, seed=1):
    return torch.randint(0, model.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def cached_and_uncached(model, tokens, prefill=12):
    """Logits at every position: one uncached pass, and a prefill then one token per step with the cache."""
    tokens = tokens.to(model.device)
    batch, length = tokens.shape
    with torch.inference_mode():
        uncached = model(tokens)
        cache = model.new_kv_cache(batch, length)
        pieces = [model(tokens[:, :prefill], 0, cache)]
        pieces += [model(tokens[:, pos:pos + 1], pos, cache) for pos in range(prefill, length)]
    return torch.cat(pieces, dim=1).float().cpu(), uncached.float().cpu()


def test_float32_cached_logits_equal_uncached_at_every_position(gqa_ckpt):
    model = build(gqa_ckpt, device="cuda").model
    assert model.device.type == "cuda"
    assert not torch.backends.cuda.matmul.allow_tf32  # PyTorch's default, which the CPU's tolerance below rests on
    cached, uncached = cached_and_uncached(model, tokens_for(model))
    torch.testing.assert_close(cached, uncached, rtol=0, atol=1e-5)


def test_float32_on_the_gpu_gives_the_cpu_s_logits(gqa_ckpt):
    tokens = tokens_for(build(gqa_ckpt).model)
    with torch.inference_mode():
        on_cpu = build(gqa_ckpt).model(tokens)
        on_gpu = build(gqa_ckpt, device="cuda").model(tokens.cuda()).cpu()
    torch.testing.assert_close(on_gpu, on_cpu, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_keeps_the_cache_within_its_rounding_and_greedy_tokens_equal(gqa_ckpt, dtype):
    llama = build(gqa_ckpt, device="cuda", dtype=dtype)
    cached, uncached = cached_and_uncached(llama.model, tokens_for(llama.model))
    assert cached.abs().max() > 0.05  # a scale against which the bound below means something
    torch.testing.assert_close(cached, uncached, rtol=0, atol=2e-2)
    prompts = [[1, 306, 465, 278], [1, 150], [1, 2172, 386, 2989, 920]]
    on, _ = llama.generate(prompts, 20, temperature=0, kv_cache=True, ignore_stop=True)
    off, _ = llama.generate(prompts, 20, temperature=0, kv_cache=False, ignore_stop=True)
    assert on == off


def test_bf16_stays_close_to_the_float32_reference(gqa_ckpt):
    """As tests/test_kv_cache_equivalence.py holds it on the CPU: both bf16 paths against float32, not each other."""
    f32 = build(gqa_ckpt, device="cuda", dtype="float32")
    bf16 = build(gqa_ckpt, device="cuda", dtype="bfloat16")
    tokens = torch.randint(0, f32.model.vocab_size, (8, 64), generator=torch.Generator().manual_seed(4))
    _, ref = cached_and_uncached(f32.model, tokens, prefill=32)
    scale = ref.abs().max().item()
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.1 * scale  # positions where float32's top token is not near a tie
    assert clear.sum() >= 8
    for got in cached_and_uncached(bf16.model, tokens, prefill=32):
        torch.testing.assert_close(got, ref, rtol=0, atol=0.05 * scale)
        assert (got - ref).abs().mean().item() < 0.01 * scale
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_float32_switch_holds_through_a_prompt_of_2100_tokens_read_in_chunks(gqa_ckpt):
    """The CPU's test at PROMPT_CHUNK's size (tests/test_kv_cache_equivalence.py) on the GPU: the same tokens,
    log-probabilities within 1e-5."""
    llama = build(gqa_ckpt, device="cuda", max_seq_len=2112, max_batch_size=1)
    prompt = torch.randint(3, llama.model.vocab_size, (2100,), generator=torch.Generator().manual_seed(5)).tolist()
    (cached,), (lp_cached,) = llama.generate([prompt], 6, temperature=0, logprobs=True, ignore_stop=True)
    (uncached,), (lp_uncached,) = llama.generate([prompt], 6, temperature=0, logprobs=True, ignore_stop=True,
                                                 kv_cache=False)
    assert len(cached) == 6 and cached == uncached
    torch.testing.assert_close(torch.tensor(lp_cached), torch.tensor(lp_uncached), rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_layers_give_the_cpu_s_tokens_and_the_cache_changes_nothing(gqa_ckpt, method):
    prompts = [[1, 306, 465, 278], [1, 150]]
    # On the CPU's exact paths a quantized model multiplies by its dequantized weights, as the GPU does.
    cpu = build(gqa_ckpt, quantize=method, quant_kernels="exact")
    gpu = build(gqa_ckpt, quantize=method, device="cuda")
    expected, expected_lp = cpu.generate(prompts, 16, temperature=0, logprobs=True, ignore_stop=True)
    on, on_lp = gpu.generate(prompts, 16, temperature=0, logprobs=True, kv_cache=True, ignore_stop=True)
    off, off_lp = gpu.generate(prompts, 16, temperature=0, logprobs=True, kv_cache=False, ignore_stop=True)
    assert on == off == expected
    torch.testing.assert_close(torch.tensor(on_lp), torch.tensor(off_lp), rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.tensor(on_lp), torch.tensor(expected_lp), rtol=0, atol=1e-3)


def test_the_compiled_step_gives_the_eager_logits(gqa_ckpt):
    llama = build(gqa_ckpt, device="cuda")
    eager, _ = cached_and_uncached(llama.model, tokens_for(llama.model))
    compiled = build(gqa_ckpt, device="cuda", compile=True)  # Inductor's Triton kernels
    tokens = tokens_for(llama.model).cuda()
    with torch.inference_mode():
        cache = compiled.model.new_kv_cache(3, 40)
        pieces = [compiled.model(tokens[:, :12], 0, cache)]
        pieces += [compiled.compiled_step(tokens[:, pos:pos + 1], pos, cache) for pos in range(12, 40)]
    torch.testing.assert_close(torch.cat(pieces, dim=1).cpu(), eager, rtol=0, atol=1e-4)
    prompts = [[1, 306, 465, 278], [1, 150]]
    assert (compiled.generate(prompts, 16, temperature=0, ignore_stop=True)[0]
            == llama.generate(prompts, 16, temperature=0, ignore_stop=True)[0])


def test_the_server_s_batched_steps_give_generate_s_answers(gqa_ckpt):

    llama = build(gqa_ckpt, device="cuda", max_seq_len=128)
    engine = make_engine(llama, num_blocks=40, block_size=4, prefill_chunk=8)  # small enough to preempt
    ps = prompts(llama)
    collectors = run_jobs(engine, [Job(p, 20, None, temperature=0) for p in ps])
    for p, c in zip(ps, collectors):
        assert c.texts() == [llama.tokenizer.decode(solo(llama, p, 20)[0])]
    engine.drain(5)
    assert engine.scheduler.pool.used == 0


def test_the_command_runs_on_the_gpu_and_the_switch_changes_nothing(nonstop_ckpt):
    # The other tests' commands run on the CPU (LLAMA_DEVICE=cpu, conftest.py); these take their default, the GPU.
    on = generate(nonstop_ckpt, "--prompt", "I believe the meaning of life is", "--echo", "--stats", env=ON_THE_GPU)
    off = generate(nonstop_ckpt, "--prompt", "I believe the meaning of life is", "--echo", "--no-kv-cache",
                   env=ON_THE_GPU)
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert on.stdout == off.stdout and on.stdout.startswith("I believe the meaning of life is")
    assert "device:          cuda" in on.stderr and "weights:         bfloat16" in on.stderr  # CUDA's default dtype


def test_meta_s_example_under_torchrun_on_the_gpu(gqa_ckpt):
    def example(*flags):
        cmd = TORCHRUN + ["--nproc_per_node=1", str(REPO / "example_text_completion.py"), "--ckpt_dir", str(gqa_ckpt),
                          "--temperature", "0", "--max_seq_len", "128", "--max_batch_size", "4", *flags]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **ON_THE_GPU})
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
        return result.stdout

    assert example() == example("--no-kv-cache")
