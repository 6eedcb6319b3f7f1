"""--compile: the compiled decode step gives what the eager one gives, and compiles once.

Inductor needs a C++ compiler on the CPU; without one these tests skip (as the CUDA tests do without a GPU).
"""

import gc
import importlib
import json
import os
import re
import shutil
import weakref

import pytest
import torch

from helpers import Always, build, run, write_tiny
from llama.kernels.build import missing
from llama.quant.linears import MulSumLinear, FewRowsLinear
from llama.speculative import Speculation

pytestmark = [
    pytest.mark.slow,
    pytest.mark.long,
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
    # Few-row float32 products on llama_kv.f32_linear wherever the kernels build (tests/kernels/test_f32_rows.py).
    assert type(compiled.model.layers[0].attention.wq) is (FewRowsLinear if missing() is None else MulSumLinear)
    # Two sequences, their steps taken in turn, each in its own cache: the step must read the cache it is handed,
    # though it keeps what it made of the last one.
    tokens = torch.randint(0, eager.model.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = eager.model(tokens)  # one uncached eager pass: the reference for every position
        caches = [compiled.model.new_kv_cache(1, 48) for _ in range(2)]
        for row, cache in enumerate(caches):
            compiled.model(tokens[row : row + 1, :3], 0, cache)
        for pos in range(3, 40):
            for row, cache in enumerate(caches):
                logits = compiled.compiled_step(tokens[row : row + 1, pos : pos + 1], pos, cache, num_logits=1)
                torch.testing.assert_close(logits[:, 0], full[row : row + 1, pos], rtol=0, atol=1e-5)


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


def test_a_finished_decode_leaves_its_cache_to_be_freed(compiled, monkeypatch):
    """The stored step keeps what it made of a cache for the next step; a finished decode's cache must still be freed,
    not held until the next decode has allocated its own."""
    made, new_kv_cache = [], compiled.model.new_kv_cache

    def recording(*args, **kwargs):
        cache = new_kv_cache(*args, **kwargs)
        made.extend(weakref.ref(t) for c in cache for t in (c.cache_k, c.cache_v))
        return cache

    monkeypatch.setattr(compiled.model, "new_kv_cache", recording)
    (tokens,), _ = compiled.generate([_tokens(compiled, PROMPTS[:1])[0]], 6, temperature=0, ignore_stop=True)
    gc.collect()
    assert len(tokens) == 6 and made and all(ref() is None for ref in made)


def test_later_calls_compile_nothing(compiled):
    """The build compiled the batch-1 cached step for every position and cache length: new prompts and
    lengths must reuse it (each recompilation would cost the user half a minute)."""
    prompts = _tokens(compiled, ["Hello", "A much longer prompt than the one before it, to move positions"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        # A one-token prompt too: its first step, at position 1, would be compiled anew if it were compiled.
        for prompt, n in ((prompts[0], 3), (prompts[1], 30), ([1], 6)):
            (tokens,), _ = compiled.generate([prompt], n, temperature=0, ignore_stop=True)
            assert len(tokens) == n



@pytest.mark.parametrize("command", ["llama-generate", "llama-server"])
def test_a_missing_compiler_is_a_one_line_error(gqa_ckpt, tmp_path, command):
    """Said before the step is exported (a minute or two of a core for the default model), naming what is missing.
    No stored package either: one built earlier would load without a compiler."""
    args = ["--prompt", "Hi"] if command == "llama-generate" else ["--port", "0"]
    result = run(command, "--ckpt-dir", gqa_ckpt, *args, "--compile",
                 env={"CXX": "/nonexistent/c++", "LLAMA_COMPILED_DIR": str(tmp_path)})
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --compile failed: ") and "no C++ compiler was found (/nonexistent/c++;" in last, last
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert packages(tmp_path) == []


def packages(directory):
    """What a packages' directory holds but the lock files of their builds (`.locks`, kept: llama/compile/aot.py)."""
    return [p for p in directory.iterdir() if p.name != ".locks"]


def _default_env(directory):
    # LLAMA_COMPILE=auto is the commands' default, which conftest.py turns off for the other tests.
    return {"LLAMA_COMPILE": "auto", "LLAMA_COMPILED_DIR": str(directory)}


def _generate_compiled(ckpt, directory, *flags):
    """llama-generate with no flag about compiling (or `flags`): the stored step, as a user gets it."""
    result = run("llama-generate", "--ckpt-dir", ckpt, "--prompt", "The history of", "--temperature", "0",
                 "--max-gen-len", "24", "--stats", *flags, env=_default_env(directory))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    return result


BUILDING = "compiling the decode step for batch size 1"


def test_the_compiled_step_is_stored_once_loaded_later_and_built_again_when_damaged(nonstop_ckpt, tmp_path):
    # Built ahead with --precompile, which generates nothing and says where the package is.
    ahead = run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--precompile", env=_default_env(tmp_path))
    assert ahead.returncode == 0 and BUILDING in ahead.stderr, ahead.stderr
    (entry,) = packages(tmp_path)  # one package, in a directory named by its key, and nothing half-written
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "step.pt2"]
    assert re.fullmatch(rf"compiled decode step for batch size 1: built in [0-9.]+ s, in {re.escape(str(entry))}\n",
                        ahead.stdout), ahead.stdout
    again = run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--precompile", env=_default_env(tmp_path))
    assert again.stdout == f"compiled decode step for batch size 1: already stored, in {entry}\n"
    temp = tmp_path.parent / "temp"  # where torch extracts a package as it loads it
    temp.mkdir()
    first = run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--prompt", "The history of", "--temperature", "0",
                "--max-gen-len", "24", "--stats", env={**_default_env(tmp_path), "TMPDIR": str(temp)})
    assert first.returncode == 0 and "Traceback" not in first.stderr, first.stderr
    assert list(temp.iterdir()) == []  # removed once loaded, not left behind at every run
    second = _generate_compiled(nonstop_ckpt, tmp_path, "--compile")  # on the CPU the flag takes the same package
    for result in (again, first, second):
        assert BUILDING not in result.stderr and "note:" not in result.stderr
    for result in (first, second):
        assert "compiled:        yes (ahead of time, loaded from disk), in " in result.stderr
    # 24 tokens, all of them (this checkpoint's greedy runs never stop early): the text is not empty.
    assert "generated:       24 tokens" in first.stderr and first.stdout.strip()
    # The chat loads the same package (a chat is batch 1) and replies as the eager step does.
    chat = run("llama-chat", "--ckpt-dir", nonstop_ckpt, "--temperature", "0", "--max-gen-len", "8", input="Hello\n",
               env=_default_env(tmp_path))
    chat_eager = run("llama-chat", "--ckpt-dir", nonstop_ckpt, "--temperature", "0", "--max-gen-len", "8", "--no-compile",
                     input="Hello\n")
    assert chat.returncode == 0 and BUILDING not in chat.stderr and chat.stdout == chat_eager.stdout, chat.stderr
    # llama-bench too: its cached steps on the stored step, its uncached ones eager, as its table says.
    bench = run("llama-bench", "--ckpt-dir", nonstop_ckpt, "--lengths", "4", "--warmup", "1", "--noplot",
                "--out-dir", tmp_path.parent / "bench", env=_default_env(tmp_path))
    assert bench.returncode == 0 and BUILDING not in bench.stderr, bench.stderr
    rows = json.loads((tmp_path.parent / "bench" / "bench.json").read_text())["rows"]
    assert {(r["kv_cache"], r["step"]) for r in rows} == {(True, "compiled"), (False, "eager")}
    assert second.stdout == first.stdout == run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--prompt", "The history of",
                                               "--temperature", "0", "--max-gen-len", "24").stdout

    def damage_package():  # a flipped byte in the generated code
        data = bytearray((entry / "step.pt2").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (entry / "step.pt2").write_bytes(bytes(data))

    def damage_meta():  # metadata that describes another torch
        meta = json.loads((entry / "meta.json").read_text())
        meta["key"]["torch"] = "0.0.1"
        (entry / "meta.json").write_text(json.dumps(meta))

    for damage, reason in [(damage_package, "does not match its digest"),
                           (damage_meta, "describes another model, torch or CPU")]:
        damage()
        # Not run: built again in the background while the eager step answers, and stored before the process ends.
        again = _generate_compiled(nonstop_ckpt, tmp_path)
        (note,) = [line for line in again.stderr.splitlines() if line.startswith("note:")]
        assert note.startswith(f"note: the stored compiled step in {entry} was not used (") and reason in note, note
        assert "compiled:        yes (ahead of time, being built in the background; " in again.stderr
        assert "storing the compiled decode step for later runs" in again.stderr
        assert again.stdout == first.stdout
        after = _generate_compiled(nonstop_ckpt, tmp_path)
        assert "compiled:        yes (ahead of time, loaded from disk), in " in after.stderr and "note:" not in after.stderr
        assert after.stdout == first.stdout
    assert [p.name for p in packages(tmp_path)] == [entry.name]


@pytest.mark.skipif(missing() is not None, reason="needs the CPU kernels' build tools")
@pytest.mark.parametrize("method, op", [("int8", "q8_0_linear"), ("int4", "q4_1_linear")])
def test_the_stored_step_calls_the_kernels_directly(gqa_ckpt, method, op):
    """The integer kernels and the row-exact attention are called through their C entry points
    (aoti_torch_cpu_<op>, llama/kernels/csrc/ops.cpp), not boxed through the dispatcher, and give what the eager
    step gives."""
    import zipfile

    # The run's shared packages (conftest.py): the batch-1 step of this shape is the one tests/kernels and
    # tests/quant build too, so it is built once a run, not once a test.
    compiled = build(gqa_ckpt, quantize=method, compile=True)
    package = compiled.compiled_step.ahead_of_time.directories[1] / "step.pt2"
    with zipfile.ZipFile(package) as z:
        (code,) = [z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp")]
    for name in (op, "attention", "rms_norm"):  # a call, not only the declaration
        assert re.search(rf"aoti_torch_cpu_{name}\((?!AtenTensorHandle)", code), name
    assert "proxy_executor_call_function" not in code
    eager = build(gqa_ckpt, quantize=method)
    prompt = [eager.tokenizer.encode("The history of", bos=True, eos=False)]
    want, want_lp = eager.generate(prompt, 12, temperature=0, ignore_stop=True, logprobs=True)
    got, got_lp = compiled.generate(prompt, 12, temperature=0, ignore_stop=True, logprobs=True)
    assert got == want and got_lp == want_lp


def test_a_package_another_process_is_building_is_waited_for_and_loaded(compiled, tmp_path, monkeypatch):
    """Two processes needing one package (a server and a command started on a first use) build it once: while
    another holds the package's lock, this one waits, then loads what the other stored."""
    import threading

    from llama.compile.aot import AheadOfTimeStep
    from llama.runtime.files import lock_file

    stored = compiled.compiled_step.ahead_of_time.directories[1]  # the batch-1 package, in the run's directory
    monkeypatch.setenv("LLAMA_COMPILED_DIR", str(tmp_path))
    step = AheadOfTimeStep(compiled.model)
    target = tmp_path / stored.name  # the same key: the same model, batch size and cache
    runners = []
    with lock_file(tmp_path / ".locks" / stored.name):  # as the other process, building
        waiter = threading.Thread(target=lambda: runners.append(step.runner(1)))
        waiter.start()
        waiter.join(2.0)
        assert waiter.is_alive() and not target.exists()  # waiting, and building nothing meanwhile
        shutil.copytree(stored, target)  # the other process's package, renamed into place
    waiter.join(60)
    assert runners and runners[0] is not None and step.built == {}  # loaded, not built
    assert packages(tmp_path) == [target]


def test_the_default_leaves_uncached_steps_eager_and_both_flags_are_refused(nonstop_ckpt, tmp_path):
    args = ("--ckpt-dir", nonstop_ckpt, "--prompt", "The history of", "--temperature", "0", "--max-gen-len", "24")
    eager = run("llama-generate", *args, "--no-compile", "--stats")
    uncached = run("llama-generate", *args, "--stats", "--no-kv-cache", env=_default_env(tmp_path))
    assert "compiled:        no" in eager.stderr and "compiled:        no" in uncached.stderr
    assert uncached.stdout == eager.stdout and not list(tmp_path.iterdir())  # nothing was built
    both = run("llama-generate", *args, "--compile", "--no-compile")
    assert both.returncode == 1 and "--compile and --no-compile contradict each other" in both.stderr
    unknown = run("llama-generate", *args, env={"LLAMA_COMPILE": "yes"})
    assert unknown.returncode == 1 and unknown.stderr == "error: LLAMA_COMPILE must be 0, 1 or auto, not 'yes'\n"


def test_without_a_compiler_the_default_runs_eagerly_with_one_note(nonstop_ckpt, tmp_path):
    result = run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--prompt", "The history of", "--temperature", "0",
                 "--max-gen-len", "12", "--stats",
                 env={"LLAMA_COMPILE": "auto", "LLAMA_COMPILED_DIR": str(tmp_path), "CXX": "/nonexistent/c++",
                      "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "the decode step runs eagerly" in notes[0], result.stderr
    assert "compiled:        no" in result.stderr


def test_a_model_the_package_cannot_hold_is_remembered_and_never_exported_again(gqa_ckpt, tmp_path, monkeypatch):
    """bf16 layers on torch's int4 kernel hold tensors that are not buffers (where this torch has that kernel): the
    default then runs eagerly, and the verdict is stored like a package, so later runs do not pay for an export."""
    monkeypatch.setenv("LLAMA_COMPILED_DIR", str(tmp_path))
    kwargs = dict(quantize="int4", dtype="bfloat16", quant_kernels="exact", compile="auto")
    first = build(gqa_ckpt, **kwargs)
    first.compiled_step.wait()  # a first run exports on the background thread, and learns the verdict there
    (entry,) = packages(tmp_path)
    meta = json.loads((entry / "meta.json").read_text())
    assert ("unsupported" in meta) == bool(first.compiled_step.ahead_of_time.failed)

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr(torch.export, "export", no_export)
    second = build(gqa_ckpt, **kwargs)
    assert (second.compiled_step is None) == ("unsupported" in meta)
    prompt = [first.tokenizer.encode("The history of", bos=True, eos=False)]
    assert second.generate(prompt, 12, temperature=0)[0] == first.generate(prompt, 12, temperature=0)[0]


def test_a_torch_the_stored_step_was_not_checked_on_runs_eagerly_with_a_note(gqa_ckpt, tmp_path, monkeypatch):
    """torch 2.11 crashes loading a package (a segmentation fault in its loader): older torches never build or load
    one. The default then runs eagerly and says why; nothing is stored."""
    from llama.compile import store

    monkeypatch.setattr(store, "SUPPORTED", False)
    monkeypatch.setenv("LLAMA_COMPILED_DIR", str(tmp_path))
    monkeypatch.setenv("LLAMA_COMPILE", "auto")  # what a user has; conftest.py sets 0
    llama = build(gqa_ckpt)  # no compile=: Llama.build's default is the commands' default, "auto"
    assert llama.compiled_step is None and not list(tmp_path.iterdir())
    assert [n for n in llama.info.notes if "needs torch 2.13 or newer" in n] == [store.UNSUPPORTED_NOTE]


def test_build_readies_the_batch_size_asked_for_and_no_other(gqa_ckpt, monkeypatch):
    """llama-generate --prompts-file with N prompts runs at batch size N: the package for N is the one loaded (or
    built) before generating, not batch 1's as well."""
    from llama.compile import aot

    asked = []

    def record(self, size):  # instead of loading: say which, and that none can be had
        asked.append(size)
        raise aot.Unsupported("not built in this test")

    monkeypatch.setattr(aot.AheadOfTimeStep, "_stored", record)
    llama = build(gqa_ckpt, compile="auto", compile_batch_size=3)
    assert asked == [3] and llama.compiled_step is None  # nothing stored could serve: the default runs eagerly


def test_the_default_generates_at_once_and_switches_to_the_stored_step_with_the_same_answer(gqa_ckpt, tmp_path,
                                                                                          monkeypatch):
    """A first run builds the stored step in the background: generation starts on the eager step and moves to the
    stored one between steps, once it is ready. On the integer kernels the two give the same bits, so the answer is
    the eager one to the bit. One cold build, on int8 weights, where a wrong switch would show in the bits: the switch
    between steps does not depend on the weights' type, and the float32 stored step's logits at every position are
    the first test's."""
    monkeypatch.setenv("LLAMA_COMPILED_DIR", str(tmp_path))
    llama = build(gqa_ckpt, quantize="int8", compile="auto")
    eager = build(gqa_ckpt, quantize="int8")
    ahead = llama.compiled_step.ahead_of_time
    assert ahead.building and "being built in the background" in llama.compiled_step.describe_origin()
    ready_at_step = []

    def on_step(pos, tokens):
        ready_at_step.append(ahead.ready(1) is not None)
        if len(ready_at_step) == 3:
            llama.compiled_step.wait()  # the package is stored now: the next step runs it

    prompt = _tokens(llama, ["I believe the meaning of life is"])
    got, lp_got = llama.generate(prompt, 12, temperature=0, logprobs=True, ignore_stop=True, on_step=on_step)
    want, lp_want = eager.generate(prompt, 12, temperature=0, logprobs=True, ignore_stop=True)
    assert ready_at_step[:3] == [False] * 3 and all(ready_at_step[3:]), ready_at_step  # a switch mid-answer
    assert got == want and lp_got == lp_want
    assert llama.compiled_step.describe_origin() == "ahead of time, built and stored" and len(packages(tmp_path)) == 1


@pytest.mark.skipif(missing() is not None, reason="needs the CPU kernels' build tools")
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_step_stored_by_a_first_run_is_loaded_by_the_second(tmp_path, quantize):
    """The first run of a bfloat16 checkpoint in Meta's layout, quantized as it loads, stores the step; the second,
    with the same flags, compiles nothing and answers the same."""
    ckpt, _ = write_tiny(tmp_path / "ckpt", dtype=torch.bfloat16)
    stored = tmp_path / "compiled"
    runs = [_generate_compiled(ckpt, stored, "--quantize", quantize) for _ in range(2)]
    assert "storing the compiled decode step for later runs" in runs[0].stderr
    assert "compiled:        yes (ahead of time, loaded from disk), in " in runs[1].stderr
    assert BUILDING not in runs[1].stderr and "storing the compiled" not in runs[1].stderr, runs[1].stderr
    assert runs[1].stdout == runs[0].stdout and len(packages(stored)) == 1


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(missing() is not None, reason="needs the CPU kernels' build tools")
def test_building_the_stored_step_copies_no_weights(tmp_path, monkeypatch):
    """The package holds no weights, so building it must not hold a copy of them: the process's resident memory,
    sampled while one layer of LLaMA-2 7B's width in int8 (about 280 MiB of weights) is compiled, grows by less
    than half the weights' size (a copy made it grow by all of it: Inductor clones every buffer a step reads, and
    the integer layers keep their weights as buffers; the step is exported from a copy holding every tensor as a
    parameter)."""
    import threading
    import time

    from llama.compile.aot import AheadOfTimeStep

    ckpt, _ = write_tiny(tmp_path / "ckpt", dim=4096, n_layers=1, n_heads=32, n_kv_heads=32, multiple_of=256,
                         dtype=torch.bfloat16)
    monkeypatch.setenv("LLAMA_COMPILED_DIR", str(tmp_path / "compiled"))
    llama = build(ckpt, quantize="int8", compile=False, compile_layers=True)
    weights = sum(t.nbytes for t in [*llama.model.parameters(), *llama.model.buffers()])
    assert weights > 200 * 2**20
    importlib.import_module("torch._inductor")  # imported by the build: its own memory is not the question

    step = AheadOfTimeStep(llama.model)
    step._example(1)  # the example inputs' cache, allocated before the baseline
    before, peak, done = _resident_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _resident_bytes())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        step.runner(1)
    finally:
        done.set()
        sampler.join()
    assert step.built, "the package was loaded, not built"
    assert peak[0] - before < weights / 2, f"{(peak[0] - before) / 2**20:.0f} MiB more while building"


@pytest.mark.skipif(missing() is not None, reason="needs the CPU kernels' build tools")
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_speculation_checks_drafts_with_a_stored_step_and_gives_the_compiled_decode(gqa_ckpt, monkeypatch, quantize):
    """With the compiled step, a draft of 3 tokens is checked by a stored package of 4 tokens, whose rows are the
    one-token step's: the same tokens as the plain compiled decode, and on the integer kernels the same bits.
    (In the run's shared packages: the batch-1 step is the other tests' of this shape.)"""
    monkeypatch.setattr(Speculation, "CHECK_COST", 0.0)  # every draft checked
    llama = build(gqa_ckpt, max_seq_len=96, compile=True, quantize=quantize)
    prompts = [[1, 5, 6, 7, 8, 5, 6, 7, 9], [1, 300, 301, 302, 300, 301, 302]]
    # Each prompt alone, as generate() speculates on each row alone: the batch-1 package (a batch of 2 would be
    # another package to build, and says nothing more about the check).
    alone = [llama.generate([p], 40, temperature=0, logprobs=True, ignore_stop=True) for p in prompts]
    plain, plain_lp = [tokens[0] for tokens, _ in alone], [logprobs[0] for _, logprobs in alone]
    spec, spec_lp = llama.generate(prompts, 40, temperature=0, logprobs=True, ignore_stop=True, speculate=Always(),
                                   draft_tokens=3)
    ahead = llama.compiled_step.ahead_of_time
    # The checking step was asked for (compile=True waits for a package rather than run eagerly) and is stored.
    assert (1, 4) in ahead.directories and ahead.directories[(1, 4)].is_dir()
    assert llama.last_speculation.checks > 20 and 0 < llama.last_speculation.accepted
    assert spec == plain
    if quantize:
        assert spec_lp == plain_lp
    else:
        for a, b in zip(spec_lp, plain_lp):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """A tiny grouped-query model with heads of 64: two int8 blocks of 32 a head, as real models have."""
    path, _ = write_tiny(tmp_path_factory.mktemp("wide"), "gqa", dim=256, n_heads=4, n_kv_heads=2)
    return path


@pytest.mark.parametrize("quantize", [None, "int8"], ids=["float32", "integer-kernels"])
def test_an_int8_kv_cache_runs_the_stored_steps_with_the_eager_answer(wide_ckpt, tmp_path, monkeypatch, quantize):
    """With kv_cache_dtype="int8" the one-token step and the step that checks a speculative draft come from stored
    packages built for an int8 cache (rows of values and their scales' bytes), and answer as the eager step does,
    bit for bit: every op between the roundings is row-exact, on the integer kernels and on float32 weights alike
    (llama/quant/linears.py, RowExactLinear)."""
    if missing() is not None:
        pytest.skip(f"the integer kernels cannot be built here: {missing()}")
    monkeypatch.setenv("LLAMA_COMPILED_DIR", str(tmp_path))
    monkeypatch.setattr(Speculation, "CHECK_COST", 0.0)  # every draft checked
    compiled = build(wide_ckpt, max_seq_len=96, kv_cache_dtype="int8", quantize=quantize, compile=True)
    eager = build(wide_ckpt, max_seq_len=96, kv_cache_dtype="int8", quantize=quantize)
    assert not [n for n in compiled.info.notes if "kv_cache_dtype" in n]
    prompt = [[1, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6]]
    want, want_lp = eager.generate(prompt, 40, temperature=0, logprobs=True, ignore_stop=True)
    runs = [compiled.generate(prompt, 40, temperature=0, logprobs=True, ignore_stop=True, **kwargs)
            for kwargs in ({}, {"speculate": Always(), "draft_tokens": 3})]
    ahead = compiled.compiled_step.ahead_of_time
    assert set(ahead.built) == {1, (1, 4)} and compiled.last_speculation.checks > 5
    metas = [json.loads((d / "meta.json").read_text()) for d in packages(tmp_path)]
    assert len(metas) == 2 and all(m["key"]["kv_dtype"] == "int8" for m in metas)
    for got, got_lp in runs:
        assert got == want and got_lp == want_lp


def test_a_bfloat16_kv_cache_on_float32_weights_runs_the_stored_step(wide_ckpt, tmp_path, monkeypatch):
    """bf16 keys and values beside float32 weights: a rounding on write, which the stored step takes as well."""
    monkeypatch.setenv("LLAMA_COMPILED_DIR", str(tmp_path))
    compiled = build(wide_ckpt, max_seq_len=96, kv_cache_dtype="bfloat16", compile=True)
    eager = build(wide_ckpt, max_seq_len=96, kv_cache_dtype="bfloat16")
    prompt = _tokens(eager, PROMPTS[:1])
    want, want_lp = eager.generate(prompt, 30, temperature=0, logprobs=True, ignore_stop=True)
    got, got_lp = compiled.generate(prompt, 30, temperature=0, logprobs=True, ignore_stop=True)
    assert compiled.compiled_step.ahead_of_time.built.keys() == {1}
    assert got == want
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), rtol=0, atol=2e-2)
