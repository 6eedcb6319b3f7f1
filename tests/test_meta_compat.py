"""A drop-in for Meta's `llama` package: its exports and signatures, and its two example scripts' calls run
unmodified under real torchrun (gloo on the CPU) with 1 and 2 processes."""

import dataclasses
import inspect
import subprocess
from pathlib import Path

import pytest
import torch

import llama
from helpers import EXAMPLE_TOKENIZER, torchrun, write_tiny
from llama import Llama

EXAMPLES = Path(__file__).resolve().parent / "meta_examples"
SEPARATOR = "=================================="
EMPTY = inspect.Parameter.empty

# The parameters of Meta's LLaMA-2 methods, in order, with their defaults (EMPTY: required).
META_SIGNATURES = {
    "build": [("ckpt_dir", EMPTY), ("tokenizer_path", EMPTY), ("max_seq_len", EMPTY), ("max_batch_size", EMPTY),
              ("model_parallel_size", None), ("seed", 1)],
    "generate": [("self", EMPTY), ("prompt_tokens", EMPTY), ("max_gen_len", EMPTY), ("temperature", 0.6),
                 ("top_p", 0.9), ("logprobs", False), ("echo", False)],
    "text_completion": [("self", EMPTY), ("prompts", EMPTY), ("temperature", 0.6), ("top_p", 0.9),
                        ("max_gen_len", None), ("logprobs", False), ("echo", False)],
    "chat_completion": [("self", EMPTY), ("dialogs", EMPTY), ("temperature", 0.6), ("top_p", 0.9),
                        ("max_gen_len", None), ("logprobs", False)],
}


def test_the_package_exports_what_metas_does():
    for name in ("Llama", "Dialog", "ModelArgs", "Transformer", "Tokenizer"):
        assert name in llama.__all__ and hasattr(llama, name), name


@pytest.mark.parametrize("method", list(META_SIGNATURES))
def test_metas_arguments_come_first_in_metas_order_with_metas_defaults(method):
    ours = list(inspect.signature(getattr(Llama, method)).parameters.values())
    assert [p.name for p in ours[: len(META_SIGNATURES[method])]] == [name for name, _ in META_SIGNATURES[method]]
    for param, (name, default) in zip(ours, META_SIGNATURES[method]):
        assert param.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD, name
        if default is not EMPTY:  # where Meta requires an argument, a default here takes nothing away
            assert param.default == default, name
    # Anything this project adds has a default, so Meta's calls never need it.
    assert all(p.default is not EMPTY for p in ours[len(META_SIGNATURES[method]):])


# Meta's ModelArgs, field by field in order, with its defaults.
META_MODEL_ARGS = [("dim", 4096), ("n_layers", 32), ("n_heads", 32), ("n_kv_heads", None), ("vocab_size", -1),
                   ("multiple_of", 256), ("ffn_dim_multiplier", None), ("norm_eps", 1e-5), ("max_batch_size", 32),
                   ("max_seq_len", 2048)]


def test_model_args_take_metas_fields_in_metas_order():
    fields = list(dataclasses.fields(llama.ModelArgs))
    assert [(f.name, f.default) for f in fields[: len(META_MODEL_ARGS)]] == META_MODEL_ARGS
    # Built positionally, as code written for Meta's class may do: max_seq_len lands in max_seq_len.
    args = llama.ModelArgs(*[value for _, value in META_MODEL_ARGS[:-2]], 4, 128)
    assert (args.max_batch_size, args.max_seq_len, args.rope_theta) == (4, 128, 10000.0)


def test_tokenizer_and_transformer_take_metas_calls():
    tokenizer = llama.Tokenizer(model_path=str(EXAMPLE_TOKENIZER))
    assert (tokenizer.n_words, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (4000, 1, 2, -1)
    ids = tokenizer.encode("Hello world", bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and tokenizer.decode(ids) == "Hello world"
    params = list(inspect.signature(llama.Transformer.forward).parameters)
    assert params[:3] == ["self", "tokens", "start_pos"]
    model = llama.Transformer(llama.ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=tokenizer.n_words))
    tokens = torch.tensor([ids])
    assert model(tokens, 0).shape == (1, len(ids), tokenizer.n_words)
    # Meta's model keeps its cache inside; this one is handed the cache, and says so when it is missing.
    with pytest.raises(ValueError, match="new_kv_cache"):
        model(tokens[:, -1:], len(ids) - 1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Two shards, as Meta ships its 13B model, with the tokenizer one level up as Meta's download puts it."""
    root = tmp_path_factory.mktemp("meta")
    path, _ = write_tiny(root / "llama-2-tiny", "gqa", num_shards=2, seed=11)
    (path / "tokenizer.model").rename(root / "tokenizer.model")
    return path


def run_example(name: str, ckpt: Path, nproc: int, env=None) -> subprocess.CompletedProcess:
    # The command lines of Meta's README, greedy so that 1 and 2 processes must print the same text.
    flags = {"text": ["--max_seq_len", "128", "--max_batch_size", "4"],
             "chat": ["--max_seq_len", "512", "--max_batch_size", "6", "--max_gen_len", "24"]}[name]
    return torchrun(EXAMPLES / f"example_{name}_completion.py", nproc, "--ckpt_dir", str(ckpt),
                    "--tokenizer_path", str(ckpt.parent / "tokenizer.model"), "--temperature", "0", *flags, env=env)


def assert_clean_stderr(stderr: str) -> None:
    """Nothing from torch at shutdown (such as a process group that was never destroyed), no traceback."""
    assert "destroy" not in stderr.lower() and "Traceback" not in stderr and "Warning" not in stderr, stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(ckpt):
    return {name: run_example(name, ckpt, nproc=1) for name in ("text", "chat")}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_text_example_prints_each_completion_once(ckpt, one_process, nproc):
    result = run_example("text", ckpt, nproc) if nproc > 1 else one_process["text"]
    out = result.stdout
    assert out.count(SEPARATOR) == 4 and out.count("\n> ") == 4
    for prompt in ("The old lighthouse keeper climbed the stairs and", "Have you ", "goose =>"):
        assert out.count(prompt) == 1, prompt
    assert out == one_process["text"].stdout  # rank 0 of two prints what one process prints
    assert_clean_stderr(result.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_chat_example_prints_each_reply_once(ckpt, one_process, nproc):
    result = run_example("chat", ckpt, nproc) if nproc > 1 else one_process["chat"]
    out = result.stdout
    assert out.count(SEPARATOR) == 5 and out.count("> Assistant: ") == 5
    assert out.count("System: Reply as a pirate would.") == 1
    # The dialog with the format's own tags is answered by Meta's error message, not run.
    assert out.count("> Assistant: Error: special tags are not allowed as part of the prompt.") == 1
    assert out == one_process["chat"].stdout
    assert_clean_stderr(result.stderr)


@pytest.mark.slow
def test_the_process_group_is_destroyed_at_exit(ckpt, tmp_path):
    script = tmp_path / "probe.py"
    # atexit runs its functions last-registered first: this one, registered before build, runs after build's.
    script.write_text(
        "import atexit, sys\n"
        "import torch.distributed as dist\n"
        "from llama import Llama\n"
        # One write per line, on both streams (print writes its parts separately, and the two ranks' parts
        # interleaved in one CI run: 'rankrank 0 of 2').
        "atexit.register(lambda: sys.stderr.write(f'group still up at exit: {dist.is_initialized()}\\n'))\n"
        "llama = Llama.build(sys.argv[1], sys.argv[2], 32, 1, device='cpu')\n"
        "sys.stdout.write(f'rank {llama.info.rank} of {llama.info.world_size}\\n')\n"
    )
    quiet = torchrun(script, 2, str(ckpt), str(ckpt.parent / "tokenizer.model"))
    assert quiet.stdout == "rank 0 of 2\n"
    assert quiet.stderr.count("group still up at exit: False") == 2  # both ranks: stderr is never silenced
    assert_clean_stderr(quiet.stderr)
    # Asking for every rank's stdout.
    loud = torchrun(script, 2, str(ckpt), str(ckpt.parent / "tokenizer.model"), env={"LLAMA_PRINT_ALL_RANKS": "1"})
    assert sorted(loud.stdout.splitlines()) == ["rank 0 of 2", "rank 1 of 2"]
