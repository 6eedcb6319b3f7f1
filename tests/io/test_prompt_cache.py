"""Prompt-cache files: the same output as a run without them, and never used when they do not belong.

A file records the model's identity, which changes with any weight, the tokenizer, the dtype or the
quantization. Another model's file, a truncated or edited one, one of a newer format, or a pickle are
refused with one sentence; the loader never unpickles anything.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from helpers import PROMPT, build, generate, run, write_tiny
from llama.runtime.files import sha256_file
from llama.io.identity import file_digests, model_identity
from llama.io.prompt_cache import PromptCacheError, load_prompt_cache, restore, save_prompt_cache
from llama.nn.session import Session
from llama.tokenizer import Tokenizer


@pytest.fixture()
def saved(gqa_ckpt, tmp_path):
    """A llama, and a prompt cache it wrote at tmp_path/p.kv holding a prompt and its continuation."""
    llama = build(gqa_ckpt)
    session = Session(llama.model)
    prompt = llama.tokenizer.encode(PROMPT, bos=True, eos=False)
    llama.generate([prompt], 6, temperature=0, session=session)
    path = save_prompt_cache(tmp_path / "p.kv", session, model_identity(llama), "tiny")
    return llama, session, path


def _load(llama, path):
    return load_prompt_cache(path, model_identity(llama), llama.model.n_layers)


def test_a_loaded_cache_holds_what_was_saved_and_answers_as_a_fresh_run(saved):
    llama, session, path = saved
    loaded = _load(llama, path)
    assert loaded.tokens == session.tokens and loaded.dialog is None
    for (k, v), (k2, v2) in zip(loaded.kv, session.kv_tensors()):
        assert torch.equal(k, k2) and torch.equal(v, v2)

    fresh_session = Session(build(Path(llama.info.ckpt_dir)).model)
    assert restore(fresh_session, loaded) == len(session.tokens)
    longer = session.tokens + llama.tokenizer.encode(" and more", bos=False, eos=False)
    got = llama.generate([longer], 10, temperature=0, logprobs=True, session=fresh_session)
    expected = llama.generate([longer], 10, temperature=0, logprobs=True)
    assert got[0] == expected[0] and fresh_session.last_reused == len(session.tokens)
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(expected[1]), rtol=0, atol=1e-5)


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_scratch(saved, monkeypatch):
    """The file is written beside itself and renamed over the old one: a failure at the last moment (here
    the rename itself) leaves the old file as it was, and nothing else in the folder."""
    llama, session, path = saved
    before = path.read_bytes()
    llama.generate([session.tokens + [7, 8, 9]], 4, temperature=0, session=session)  # now holds more

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        save_prompt_cache(path, session, model_identity(llama), "tiny")
    monkeypatch.undo()
    assert path.read_bytes() == before and [f.name for f in path.parent.iterdir()] == [path.name]
    assert _load(llama, path).tokens != session.tokens  # still the old, whole file


def test_identity_changes_with_weights_tokenizer_dtype_and_quantization(gqa_ckpt, tmp_path):
    llama = build(gqa_ckpt)
    base = model_identity(llama)
    assert model_identity(build(gqa_ckpt)) == base  # the same files: the same identity

    other, _ = write_tiny(tmp_path / "other", "gqa", seed=1)  # other weights, same shape and tokenizer
    assert model_identity(build(other)) != base

    retok = tmp_path / "retok"
    shutil.copytree(gqa_ckpt, retok)
    (retok / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert model_identity(build(retok)) != base

    assert model_identity(build(gqa_ckpt, dtype="bfloat16")) != base

    quantized = build(gqa_ckpt)
    quantized.info.quantization = "int8"  # what build(quantize=...) sets
    assert model_identity(quantized) != base


def test_a_weight_file_changed_in_place_is_hashed_again(gqa_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(gqa_ckpt, ckpt)
    digests = tmp_path / "digests.json"
    weights = ckpt / "consolidated.00.pth"
    first = file_digests([weights], digests)
    assert json.loads(digests.read_text())  # remembered
    assert file_digests([weights], digests) == first
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # same size, other bytes, a new mtime
    weights.write_bytes(bytes(data))
    assert file_digests([weights], digests) != first
    assert len(json.loads(digests.read_text())) == 1  # the stale entry was replaced


@pytest.mark.parametrize("size", [0, 1, (1 << 18) - 1, 1 << 18, (1 << 18) + 1, 3 * (1 << 18) + 5])
def test_a_files_digest_is_the_sha256_of_every_byte(tmp_path, size):
    """sha256_file reads through one buffer (llama/runtime/files.py): files shorter, as long and longer than it, and
    several buffers long with a remainder, are hashed whole."""
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_another_models_file_is_refused(saved, tmp_path):
    _, _, path = saved
    other, _ = write_tiny(tmp_path / "other", "gqa", seed=1)
    with pytest.raises(PromptCacheError, match="was made by tiny, not by the model loaded now"):
        _load(build(other), path)


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_truncated_edited_newer_and_foreign_files_are_refused(saved, tmp_path):
    llama, _, path = saved
    data = path.read_bytes()

    truncated = tmp_path / "truncated.kv"
    truncated.write_bytes(data[: len(data) - 50])
    with pytest.raises(PromptCacheError, match="damaged or truncated") as e:
        _load(llama, truncated)
    _one_line(e)

    edited = tmp_path / "edited.kv"
    flipped = bytearray(data)
    flipped[-5] ^= 0x01  # one bit of one value
    edited.write_bytes(bytes(flipped))
    with pytest.raises(PromptCacheError, match="changed after it was written"):
        _load(llama, edited)

    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    newer = tmp_path / "newer.kv"
    newer.write_bytes(safetensors_bytes(tensors, metadata={**metadata, "version": "2"}))
    with pytest.raises(PromptCacheError, match="format 2, newer than"):
        _load(llama, newer)

    retokened = tmp_path / "retokened.kv"
    retokened.write_bytes(safetensors_bytes(tensors, metadata={**metadata, "tokens": "[1, 2, 3]"}))
    with pytest.raises(PromptCacheError, match="changed after it was written"):
        _load(llama, retokened)

    text = tmp_path / "text.kv"
    text.write_text("hello")
    with pytest.raises(PromptCacheError, match="damaged or truncated"):
        _load(llama, text)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ.get("BOOM_MARK", "/nonexistent"),))


def test_a_pickle_is_never_unpickled(saved, tmp_path, monkeypatch):
    llama, _, _ = saved
    mark = tmp_path / "unpickled"
    monkeypatch.setenv("BOOM_MARK", str(mark))
    hostile = tmp_path / "hostile.kv"
    torch.save({"payload": _Boom()}, hostile)
    with pytest.raises(PromptCacheError):
        _load(llama, hostile)
    assert not mark.exists()


def generate_tokens(ckpt, *args):
    """llama-generate's tokens (10 at the most, greedy) and its stderr."""
    result = generate(ckpt, "--max-gen-len", "10", "--json", *args)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)["tokens"], result.stderr


@pytest.mark.slow
def test_generate_with_a_prompt_cache_prints_what_it_prints_without(gqa_ckpt, tmp_path):
    cache = tmp_path / "prompt.kv"
    short, longer = PROMPT, PROMPT + " to be kind to one another"
    llama = build(gqa_ckpt)
    plain_short, plain_longer = (llama.generate([llama.tokenizer.encode(p, bos=True, eos=False)], 10, temperature=0)[0][0]
                                 for p in (short, longer))

    tokenizer = Tokenizer(str(gqa_ckpt / "tokenizer.model"))
    n_short, n = (len(tokenizer.encode(p, bos=True, eos=False)) for p in (short, longer))
    assert tokenizer.encode(longer, bos=True, eos=False)[:n_short] == tokenizer.encode(short, bos=True, eos=False)

    first, _ = generate_tokens(gqa_ckpt, "--prompt", short, "--prompt-cache", cache)
    assert first == plain_short and cache.is_file()
    second, err = generate_tokens(gqa_ckpt, "--prompt", longer, "--prompt-cache", cache, "--stats")
    assert second == plain_longer
    assert f"prompt cache:    {n_short} tokens reused, {n - n_short} prefilled" in err

    # A damaged file is ignored in one line, the output is unchanged, and a good file replaces it.
    cache.write_bytes(cache.read_bytes()[:-10])
    third, err = generate_tokens(gqa_ckpt, "--prompt", longer, "--prompt-cache", cache, "--stats")
    assert third == plain_longer
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "damaged or truncated" in notes[0] and "prompt cache:    0 tokens reused" in err
    fourth, err = generate_tokens(gqa_ckpt, "--prompt", longer, "--prompt-cache", cache, "--stats")
    assert fourth == plain_longer and "note:" not in err
    assert f"prompt cache:    {n - 1} tokens reused, 1 prefilled" in err  # all but the last, which picks the next


@pytest.mark.slow
def test_generate_refuses_a_prompt_cache_it_cannot_use_or_write(gqa_ckpt, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\n")
    cases = [(tmp_path / "p.kv", ["--prompts-file", prompts], "--prompt-cache keeps"),
             (tmp_path / "p.kv", ["--prompt", PROMPT, "--no-kv-cache"], "--prompt-cache keeps"),
             (tmp_path / "nowhere" / "p.kv", ["--prompt", PROMPT], "the folder")]
    for path, args, message in cases:
        result = run("llama-generate", "--ckpt-dir", gqa_ckpt, "--prompt-cache", path, *args)
        assert result.returncode == 1 and result.stderr.startswith("error: " + message)
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.kv").exists()


def _saved_by(llama, path):
    session = Session(llama.model)
    llama.generate([llama.tokenizer.encode(PROMPT, bos=True, eos=False)], 6, temperature=0, session=session)
    return session, save_prompt_cache(path, session, model_identity(llama), "tiny")


def _load_for(llama, path):
    return load_prompt_cache(path, model_identity(llama), llama.model.n_layers, llama.model.kv_cache_dtype)


def test_an_int8_file_records_int8_resumes_with_the_same_tokens_and_is_refused_by_another_kv_dtype(gqa_ckpt, tmp_path):
    int8 = build(gqa_ckpt, kv_cache_dtype="int8")
    session, path = _saved_by(int8, tmp_path / "int8.kv")
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["kv_dtype"] == "int8" and f.get_tensor("layers.0.keys").dtype == torch.int8
    loaded = _load_for(int8, path)
    resumed = Session(int8.model)
    assert restore(resumed, loaded) == len(session.tokens)
    longer = session.tokens + int8.tokenizer.encode(" and more", bos=False, eos=False)
    got = int8.generate([longer], 10, temperature=0, logprobs=True, session=resumed)
    expected = int8.generate([longer], 10, temperature=0, logprobs=True)
    assert got == expected and resumed.last_reused == len(session.tokens)  # row-exact under an int8 cache

    for other in (build(gqa_ckpt), build(gqa_ckpt, kv_cache_dtype="bfloat16")):
        held = str(other.model.kv_cache_dtype).removeprefix("torch.")
        with pytest.raises(PromptCacheError, match=f"holds keys and values in int8, not in {held} .*"
                                                   r"\(kv_cache_dtype=int8 reads it\)") as e:
            _load_for(other, path)
        _one_line(e)
        with pytest.raises(PromptCacheError, match="does not fit"):  # unchecked at load, the session still refuses
            restore(Session(other.model), loaded)
    _, float_path = _saved_by(build(gqa_ckpt), tmp_path / "float32.kv")
    with pytest.raises(PromptCacheError, match="holds keys and values in float32, not in int8"):
        _load_for(int8, float_path)


@pytest.mark.slow
def test_generate_says_in_one_note_that_a_prompt_cache_holds_another_kv_dtype(gqa_ckpt, tmp_path):
    cache = tmp_path / "prompt.kv"
    plain, _ = generate_tokens(gqa_ckpt, "--prompt", PROMPT)
    first, err = generate_tokens(gqa_ckpt, "--prompt", PROMPT, "--prompt-cache", cache, "--kv-cache-dtype", "int8")
    assert cache.is_file() and "note:" not in err
    again, err = generate_tokens(gqa_ckpt, "--prompt", PROMPT, "--prompt-cache", cache)
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert again == plain and len(notes) == 1
    assert "holds keys and values in int8, not in float32" in notes[0] and "--kv-cache-dtype int8 reads it" in notes[0]
