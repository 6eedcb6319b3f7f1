"""The KV-cache switch on the real default model in the mode users get with no flag: cached steps on the stored
compiled decode step, uncached passes eager. Tiny random models cannot show a difference between the two (they
keep rounding gaps small); 30 layers of activations rounded to int8 turn any into a different text within a few
tokens. So: 8 prompts of mixed kinds x 48 greedy tokens, for float32, int8 and int4, and 4 of them x 32 tokens for
int8 and int4 on every other kernel path this CPU runs (one on the scalar loops).

What holds (README, "What the switch guarantees"): on the integer kernels the same tokens and the same
log-probabilities bit for bit; in float32 the same tokens, log-probabilities within FLOAT32_BOUND (the compiled
step's products sum in another order than MKL's); with int8 keys and values (`--kv-cache-dtype int8`), float32
too bit for bit.
"""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from llama import Llama, kernels
from llama.convert.fetch import default_model_dir
from llama.runtime import threads

from helpers import uncached_in_one_pass

pytestmark = [pytest.mark.slow, pytest.mark.long]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Three things to pack for a hike:",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "1, 1, 2, 3, 5, 8,",
    "Translate to French: good morning, my friend.",
    "import numpy as np\n\narr = np.",
    "Le chat est sur",
]
TOKENS = 48
# The other kernel paths on the first four prompts for 32 tokens: text, code, a list and chat. The scalar loops, the
# slowest path by far (the loops tests/kernels holds every path to, bit for bit), on the first.
PATH_PROMPTS, PATH_TOKENS = PROMPTS[:4], 32
SCALAR_PROMPTS = PROMPTS[:1]
FLOAT32_BOUND = 1e-4  # largest |cached - uncached| log-probability seen over these prompts: 1.4e-5


def _build(quantize, kv_cache_dtype=None, stored=True):
    """The default model in the default mode; `stored`: its compiled step loaded from disk, as stored_steps left it."""
    llama = Llama.build(default_model_dir(), max_seq_len=128, max_batch_size=len(PROMPTS), device="cpu", dtype="float32",
                        quantize=quantize, compile="auto", kv_cache_dtype=kv_cache_dtype)
    assert llama.compiled_step is not None
    llama.compiled_step.wait()  # a first run builds it in the background; the test is of the stored step
    origin = llama.compiled_step.describe_origin()
    assert origin == "ahead of time, loaded from disk" if stored else origin.startswith("ahead of time, "), origin
    return llama


# (quantize, kv_cache_dtype) of every model the tests below build: each has a stored step of its own.
BUILDS = [(None, None), ("int8", None), ("int4", None), (None, "int8")]


@pytest.fixture(scope="module", autouse=True)
def stored_steps():
    """The four stored steps, built before the tests load them: two at a time, each by `_build` in a process of its
    own. A build is one export and one compiler run, a minute or more of one core for this model; in the tests'
    process the four would run one after another while the second core waited. The tests then load what these
    stored, as a user's later runs do (where a package is stored already, a process only loads it)."""
    code = (f"import sys, torch; torch.set_num_threads({torch.get_num_threads()}); "  # the threads are in the key
            f"sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_switch_exact import _build; "
            "_build(sys.argv[1] or None, sys.argv[2] or None, stored=False)")

    def build_elsewhere(args):
        return subprocess.run([sys.executable, "-c", code, *(a or "" for a in args)], capture_output=True, text=True,
                              timeout=1200)

    with ThreadPoolExecutor(2) as pool:
        for args, result in zip(BUILDS, pool.map(build_elsewhere, BUILDS)):
            assert result.returncode == 0, (args, result.stderr[-3000:])


@pytest.fixture(scope="module", params=[None, "int8", "int4"], ids=["float32", "int8", "int4"])
def llama(request) -> Llama:
    return _build(request.param)


def _greedy(llama: Llama, ids, kv_cache: bool, n: int = TOKENS):
    (tokens,), (logprobs,) = llama.generate([ids], n, temperature=0, logprobs=True, ignore_stop=True,
                                            kv_cache=kv_cache)
    return tokens, torch.tensor(logprobs, dtype=torch.float64)


def _each_alone_against_one_uncached_batch(llama: Llama, bound: float = 0.0):
    """Each prompt alone with the cache (the batch-1 stored step) against all eight in one uncached batch: the same
    tokens, log-probabilities within `bound` (0: the same bits)."""
    ids = [llama.tokenizer.encode(prompt, bos=True, eos=False) for prompt in PROMPTS]
    batch, batch_lp = llama.generate(ids, TOKENS, temperature=0, logprobs=True, ignore_stop=True, kv_cache=False)
    for prompt, row, uncached, lp_uncached in zip(PROMPTS, ids, batch, batch_lp):
        cached, lp_cached = _greedy(llama, row, kv_cache=True)
        lp_uncached = torch.tensor(lp_uncached, dtype=torch.float64)
        assert cached == uncached, prompt
        if bound == 0.0:
            assert torch.equal(lp_cached, lp_uncached), (prompt, (lp_cached - lp_uncached).abs().max().item())
        else:
            assert (lp_cached - lp_uncached).abs().max().item() <= bound, prompt


def test_cache_on_and_off_give_the_same_answer_in_the_default_mode(llama):
    """A row's answer does not depend on the cache, nor on the rows beside it."""
    integer = llama.info.quant_kernels == "integer"
    assert integer == (llama.info.quantization is not None)  # the quantized models run on the integer kernels
    _each_alone_against_one_uncached_batch(llama, 0.0 if integer else FLOAT32_BOUND)


def test_a_step_on_one_thread_or_two_gives_the_same_bits(llama, monkeypatch):
    """The default mode moves the decode step's threads with the cores they get (llama/runtime/threads.py). Switched
    between one and two at every step, the tokens and log-probabilities are those of steps on two throughout."""
    assert llama.step_threads is not None and torch.get_num_threads() == 2
    ids = llama.tokenizer.encode(PROMPTS[1], bos=True, eos=False)
    llama.step_threads.now = 2
    monkeypatch.setattr(threads, "choose_threads", lambda now, most, *_: most)
    tokens, logprobs = _greedy(llama, ids, kv_cache=True)
    monkeypatch.setattr(threads, "WINDOW_S", 0.0)
    monkeypatch.setattr(threads, "choose_threads", lambda now, most, *_: 1 if now == most else most)
    changes = len(llama.step_threads.changes)
    switched, switched_logprobs = _greedy(llama, ids, kv_cache=True)
    assert len(llama.step_threads.changes) - changes >= TOKENS - 2  # every step after the prompt's
    assert switched == tokens
    assert torch.equal(switched_logprobs, logprobs), (switched_logprobs - logprobs).abs().max().item()
    assert torch.get_num_threads() == 2  # the caller's count back after the decode


def test_an_int8_kv_cache_keeps_the_switch_exact_on_float32_weights():
    """`--kv-cache-dtype int8` on the default model's float32 weights, in the default mode: every product row-exact
    (RowExactLinear, llama/quant/linears.py), so cached and uncached give the same tokens and log-probabilities bit
    for bit. The uncached side is `uncached_in_one_pass` (the generation loop without the cache is the same as
    the test above runs in full on these prompts; each of its steps here would be a float32 pass over a batch of 8)."""
    llama = _build(None, kv_cache_dtype="int8")
    assert llama.info.layer_plan.row_exact
    ids = [llama.tokenizer.encode(prompt, bos=True, eos=False) for prompt in PROMPTS]
    cached = [_greedy(llama, row, kv_cache=True) for row in ids]
    uncached = uncached_in_one_pass(llama, ids, [tokens for tokens, _ in cached])
    for prompt, (tokens, lp_cached), (argmax, lp_uncached) in zip(PROMPTS, cached, uncached):
        assert argmax == tokens, prompt
        assert torch.equal(lp_uncached, lp_cached), (prompt, (lp_uncached - lp_cached).abs().max().item())


@pytest.fixture(scope="module")
def paths():
    """The paths the test above did not run. The emulated VNNI path (for tests: the AVX-VNNI code on AVX2) only where
    the CPU has no AVX-VNNI, and AVX-512 without VNNI only where the CPU has no AVX-512 VNNI: each is the other's
    code with its dot-product instruction written otherwise, and tests/kernels holds both to the scalar loop bit for
    bit. AVX-512 VNNI only where the CPU has no AMX path, which runs its code for a step's few rows."""
    assert kernels.load()
    cpu = kernels.cpu_paths()
    skip = {kernels.best_path(), "avxvnni-emulated" if "avxvnni" in cpu else None,
            "avx512" if "avx512vnni" in cpu else None, "avx512vnni" if "amx" in cpu else None}
    return [p for p in cpu if p not in skip]


@pytest.mark.parametrize("llama", ["int8", "int4"], indirect=True)  # the models of the test above, not loaded again
def test_every_kernel_path_keeps_the_switch_exact(llama, paths):
    """Each path the CPU has, forced as LLAMA_KERNEL_PATH forces it, through the same stored step. The uncached side
    is `uncached_in_one_pass`, so that the scalar path stays affordable."""
    for path in paths:
        with kernels.options(path=path):
            for prompt in SCALAR_PROMPTS if path == "scalar" else PATH_PROMPTS:
                ids = llama.tokenizer.encode(prompt, bos=True, eos=False)
                cached, lp_cached = _greedy(llama, ids, kv_cache=True, n=PATH_TOKENS)
                ((argmax, lp_uncached),) = uncached_in_one_pass(llama, [ids], [cached])
                assert argmax == cached, (path, prompt)
                assert torch.equal(lp_uncached, lp_cached), (path, prompt, (lp_uncached - lp_cached).abs().max().item())
