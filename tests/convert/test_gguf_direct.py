"""A GGUF file or a Hugging Face folder given where a checkpoint goes (issue 26): converted once into
$LLAMA_HOME/converted, equal to the same source converted by hand, converted again when it changes or its
entry is damaged, and safe when two processes convert it at once."""

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import httpx
import pytest
import torch

from helpers import PROMPT, REPO, assert_one_line_error, run, save_hf, tiny_hf_model, write_gguf
from gguf_writer import write_llama_gguf
from llama import Llama
from llama.io.checkpoint import load_shard
from llama.convert import cache
from llama.convert.cache import MANIFEST, entry_damage, resolve_checkpoint, sample_digest
from llama.errors import LlamaError
from llama.runtime import files
from llama.runtime.paths import home_dir

pytest.importorskip("transformers")

# Read before any test points LLAMA_HOME elsewhere: where the real default model's GGUF lives.
REAL_HOME = home_dir()


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """A fresh, empty $LLAMA_HOME for every test (subprocesses inherit it)."""
    path = tmp_path / "llama-home"
    monkeypatch.setenv("LLAMA_HOME", str(path))
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A float GGUF and a Hugging Face folder of one tiny model (the example tokenizer), and a GGUF with
    Q8_0 weights, each with the checkpoint `llama-convert` makes of it by hand."""
    from llama.convert.gguf import convert_gguf
    from llama.convert.hf import convert_hf

    root = tmp_path_factory.mktemp("sources")
    model = tiny_hf_model(tied=False)
    out = {
        "gguf": write_gguf(model, root / "tiny.gguf"),
        "hf": save_hf(model, root / "hf"),
        "q8_0": write_llama_gguf(root / "tiny-q8_0.gguf"),
    }
    hand = {"gguf": convert_gguf(out["gguf"], root / "hand-gguf"), "hf": convert_hf(out["hf"], root / "hand-hf"),
            "q8_0": convert_gguf(out["q8_0"], root / "hand-q8_0")}
    return out, hand


def build(ckpt) -> Llama:
    return Llama.build(ckpt, max_seq_len=64, max_batch_size=2, device="cpu", dtype="float32")


def assert_same_model(ours: Llama, theirs: Llama) -> None:
    """Logits within 1e-5 at every position and the same 16 greedy tokens."""
    vocab = ours.model.params.vocab_size
    ids = torch.randint(3, vocab, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.model(ids), theirs.model(ids), rtol=0, atol=1e-5)
    prompts = [ids[0, :5].tolist(), ids[1, :9].tolist()]
    a, _ = ours.generate(prompts, max_gen_len=16, temperature=0, ignore_stop=True)
    b, _ = theirs.generate(prompts, max_gen_len=16, temperature=0, ignore_stop=True)
    assert a == b and all(len(t) == 16 for t in a)


def assert_same_files(entry: Path, hand: Path) -> None:
    """The entry holds what llama-convert wrote, quantized blocks included, tensor for tensor."""
    assert sorted(p.name for p in entry.iterdir()) == sorted([p.name for p in hand.iterdir()] + [MANIFEST])
    ours, theirs = load_shard(entry / "consolidated.00.pth"), load_shard(hand / "consolidated.00.pth")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    for name in ("params.json", "tokenizer.model", "tokenizer_config.json", "quantization.json"):
        if (hand / name).exists():
            assert (entry / name).read_bytes() == (hand / name).read_bytes(), name


def snapshot(entry: Path) -> dict:
    """Each file's inode and modification time: a conversion that ran would change them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in entry.iterdir()}


@pytest.mark.parametrize("kind", ["gguf", "q8_0", "hf"])
def test_a_source_given_directly_equals_it_converted_by_hand(sources, home, kind):
    src, hand = sources[0][kind], sources[1][kind]
    direct = build(src)
    assert direct.info.ckpt_dir.parent == home / "converted"
    assert_same_files(direct.info.ckpt_dir, hand)
    assert_same_model(direct, build(hand))
    if kind == "q8_0":  # quantized blocks kept as stored, as llama-convert keeps them
        assert direct.info.quantization is not None and direct.info.quantization == build(hand).info.quantization


def test_a_second_use_converts_nothing(sources, home, monkeypatch):
    src = sources[0]["gguf"]
    reports, notes = [], []
    entry = resolve_checkpoint(src, progress=lambda *r: reports.append(r[0]), notice=notes.append)
    assert {"reading GGUF tensors", "writing checkpoint"} <= set(reports)
    assert len(notes) == 1 and notes[0].startswith(f"converting {src} once into {entry}: about ") and " free)" in notes[0]
    before = snapshot(entry)

    def no_conversion(*args, **kwargs):
        raise AssertionError("a second use converted again")

    monkeypatch.setattr(cache, "_convert", no_conversion)
    monkeypatch.setattr("llama.convert.gguf.read_gguf", no_conversion)
    reports.clear(), notes.clear()
    assert resolve_checkpoint(src, progress=lambda *r: reports.append(r[0]), notice=notes.append) == entry
    assert build(src).info.ckpt_dir == entry
    assert reports == [] and notes == [] and snapshot(entry) == before


def test_a_moved_file_is_not_converted_again(sources, tmp_path):
    src = tmp_path / "a.gguf"
    shutil.copy2(sources[0]["q8_0"], src)
    entry = resolve_checkpoint(src)
    moved = src.rename(tmp_path / "renamed.gguf")  # a rename keeps size, mtime and contents
    notes = []
    assert resolve_checkpoint(moved, notice=notes.append) == entry and notes == []


def test_a_changed_file_is_converted_again(sources, home, tmp_path):
    src = tmp_path / "model.gguf"
    write_llama_gguf(src, seed=0)
    first = resolve_checkpoint(src)
    old = build(first)
    write_llama_gguf(src, seed=1)  # the same shapes and size, other weights, a new mtime
    notes = []
    second = resolve_checkpoint(src, notice=notes.append)
    assert second != first and notes[0].startswith("converting")
    assert not first.exists()  # the entry of the file as it was can never be used again: removed
    from llama.convert.gguf import convert_gguf

    assert_same_model(build(second), build(convert_gguf(src, tmp_path / "hand")))
    ids = torch.tensor([[1, 50, 60, 70]])
    with torch.no_grad():
        assert not torch.allclose(old.model(ids), build(second).model(ids))


def test_a_rewrite_that_keeps_size_and_mtime_is_still_seen(sources, tmp_path):
    """The digest, not only size and mtime: `cp -p` of another model of the same size, say."""
    src = tmp_path / "model.gguf"
    write_llama_gguf(src, seed=0)
    st = src.stat()
    first = resolve_checkpoint(src)
    write_llama_gguf(src, seed=1)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert src.stat().st_size == st.st_size and src.stat().st_mtime_ns == st.st_mtime_ns
    assert resolve_checkpoint(src) != first


def test_a_changed_hugging_face_folder_is_converted_again(sources, tmp_path):
    src = save_hf(tiny_hf_model(tied=False), tmp_path / "hf")
    first = resolve_checkpoint(src)
    model = tiny_hf_model(tied=False)
    with torch.no_grad():
        model.model.norm.weight.mul_(2)
    model.save_pretrained(src, safe_serialization=True)  # the same file names and sizes
    second = resolve_checkpoint(src)
    assert second != first and entry_damage(second) is None


def _truncate(entry):
    path = entry / "consolidated.00.pth"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_last_byte(entry):
    path = entry / "consolidated.00.pth"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_params(entry):
    path = entry / "params.json"
    text = path.read_text()
    edited = text.replace('"n_layers": 2', '"n_layers": 1')
    assert edited != text and len(edited) == len(text)  # the same size: only the digest can tell
    path.write_text(edited)


DAMAGE = {
    "truncated weights": _truncate,
    "weights edited, same size": _flip_last_byte,
    "params.json edited, same size": _edit_params,
    "tokenizer deleted": lambda e: (e / "tokenizer.model").unlink(),
    "manifest deleted": lambda e: (e / MANIFEST).unlink(),
    "manifest not JSON": lambda e: (e / MANIFEST).write_text("{"),
    "a shard added": lambda e: shutil.copy(e / "consolidated.00.pth", e / "consolidated.01.pth"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_rebuilt_never_loaded(sources, damage):
    src, hand = sources[0]["q8_0"], sources[1]["q8_0"]
    entry = resolve_checkpoint(src)
    DAMAGE[damage](entry)
    assert entry_damage(entry) is not None
    notes = []
    assert resolve_checkpoint(src, notice=notes.append) == entry
    assert "is damaged" in notes[0] and notes[1].startswith("converting")
    assert entry_damage(entry) is None
    assert_same_files(entry, hand)
    assert [p.name for p in entry.parent.iterdir() if p.name.startswith(".") and p.name != ".locks"] == []


def test_an_entry_of_the_previous_format_is_replaced_never_loaded(sources):
    """Entries converted before the embedding stayed quantized (its float32 copy up to 4x the room) say format 1 in
    their manifest and sit under a key made with it: the source converts into a new entry and the old one goes."""
    src = sources[0]["q8_0"]
    entry = resolve_checkpoint(src)
    old = entry.with_name("0" * len(entry.name))  # where the previous version's key put it
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest.update(format=1, key=old.name, identity={**manifest["identity"], "format": 1})
    (entry / MANIFEST).write_text(json.dumps(manifest))
    entry.rename(old)
    assert entry_damage(old) == f"its {MANIFEST} is from another version or another entry"
    notes = []
    assert resolve_checkpoint(src, notice=notes.append) == entry
    assert notes[0].startswith("converting") and not old.exists()
    assert_same_files(entry, sources[1]["q8_0"])
    assert load_shard(entry / "consolidated.00.pth")["tok_embeddings.weight"].dtype == torch.int8  # kept as Q8_0


CONCURRENT = r"""
import json, sys
import llama.convert.cache as cache
import llama.runtime.files as files
if sys.argv[2] == "no-lock":
    files.fcntl = None  # as on a system without locks: only the rename into place protects the entry
print("ready", flush=True)
sys.stdin.readline()  # both processes start converting when the test says go
notes = []
entry = cache.resolve_checkpoint(sys.argv[1], notice=notes.append)
print(json.dumps({"entry": str(entry), "notes": notes}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("locking", ["lock", "no-lock"])
def test_two_processes_converting_at_once_both_succeed(sources, home, locking):
    src, hand = sources[0]["gguf"], sources[1]["gguf"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(src), locking], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        for p in procs:  # released together, so that the two conversions overlap
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    outs = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    entry = Path(outs[0]["entry"])
    assert outs[1]["entry"] == str(entry) and entry_damage(entry) is None
    converted = sum(any(n.startswith("converting") for n in o["notes"]) for o in outs)
    # With the lock one converts and the other waits; without it both may convert, and one entry stays.
    assert converted == 1 if locking == "lock" else converted in (1, 2)
    assert_same_files(entry, hand)
    assert sorted(p.name for p in entry.parent.iterdir()) == [".locks", entry.name]  # no staging left behind


def test_without_locks_a_late_conversion_keeps_the_finished_entry(sources, monkeypatch):
    """Where the second of two unlocked conversions finishes, the rename finds the first's entry in place:
    it keeps it, whole, and drops its own copy."""
    monkeypatch.setattr(files, "fcntl", None)
    src = sources[0]["q8_0"].resolve()
    entry = resolve_checkpoint(src)
    before, manifest = snapshot(entry), (entry / MANIFEST).read_bytes()
    cache._convert(src, "gguf", entry, cache._source_identity(src, "gguf"), None, None)
    assert snapshot(entry) == before and (entry / MANIFEST).read_bytes() == manifest
    assert sorted(p.name for p in entry.parent.iterdir()) == [".locks", entry.name]


def test_a_conversion_that_would_not_fit_is_refused_before_writing(sources, home, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(LlamaError, match=r"converting tiny.gguf needs about .* but only 1.0 kB is free there"):
        resolve_checkpoint(sources[0]["gguf"])
    assert not home.exists()  # nothing written, not even the cache's directory


def test_a_path_that_is_no_model_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(LlamaError, match="is a file but not a GGUF file"):
        resolve_checkpoint(tmp_path / "notes.txt")
    with pytest.raises(LlamaError, match="missing.gguf does not exist"):
        resolve_checkpoint(tmp_path / "missing.gguf")


def test_the_sampled_digest_sees_the_header_and_the_samples(tmp_path):
    """Past 4 MiB beyond the header, a file is hashed by its header and 16 samples (first and last 64 KiB
    of the rest included)."""
    path = tmp_path / "big"
    data = bytearray(os.urandom(32 << 20))
    path.write_bytes(bytes(data))
    base = sample_digest(path, header_bytes=1 << 20)
    for offset in (1000, (1 << 20) - 1, 1 << 20, len(data) - 1):  # in the header, its end, the first and last sample
        data[offset] ^= 1
        path.write_bytes(bytes(data))
        assert sample_digest(path, header_bytes=1 << 20) != base, offset
        data[offset] ^= 1
    path.write_bytes(bytes(data))
    assert sample_digest(path, header_bytes=1 << 20) == base


# Through the commands, as a user coming from llama.cpp runs them.

def gen(*args):
    return run("llama-generate", "--prompt", PROMPT, "--temperature", "0", "--max-gen-len", "8", "--json", *args)


@pytest.mark.slow
def test_llama_generate_takes_a_gguf_with_m(sources):
    src, hand = sources[0]["gguf"], sources[1]["gguf"]
    first, again = gen("-m", src), gen("--model", src)
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    by_hand = build(hand)
    prompt = by_hand.tokenizer.encode(PROMPT, bos=True, eos=False)
    expected, _ = by_hand.generate([prompt], max_gen_len=8, temperature=0)
    assert json.loads(first.stdout)["tokens"] == json.loads(again.stdout)["tokens"] == expected[0]
    converting = [line for line in first.stderr.splitlines() if line.startswith("llama-convert: converting")]
    assert len(converting) == 1 and " free)" in converting[0]  # the disk it takes, said once
    assert "llama-convert: writing checkpoint: 100%" in first.stderr
    assert "llama-convert" not in again.stderr  # the second use converts nothing


@pytest.mark.slow
@pytest.mark.parametrize("command", ["llama-chat", "llama-perplexity", "llama-bench", "example_text_completion.py",
                                     "example_chat_completion.py"])
def test_every_command_takes_m(sources, tmp_path, command):
    src = sources[0]["gguf"]
    resolve_checkpoint(src)  # converted already: what is tested is that the command takes -m
    args = {
        "llama-chat": ["--temperature", "0", "--max-gen-len", "4"],
        "llama-perplexity": [REPO / "data" / "alice29.txt", "--ctx", "16", "--windows", "1"],
        "llama-bench": ["--lengths", "4", "--batch-sizes", "1", "--modes", "cache", "--warmup", "0",
                        "--out-dir", tmp_path, "--noplot", "--max-seq-len", "64"],
        "example_text_completion.py": ["--temperature", "0", "--max_gen_len", "2"],
        "example_chat_completion.py": ["--temperature", "0", "--max_gen_len", "2"],
    }[command]
    result = run(command, "-m", src, *args, input="hello\n" if command == "llama-chat" else None)
    assert result.returncode == 0, result.stderr
    assert "llama-convert" not in result.stderr


@pytest.mark.slow
def test_llama_server_takes_m(sources):
    from helpers import Server

    src = sources[0]["gguf"]
    resolve_checkpoint(src)
    server = Server(None, "-m", src, max_seq_len=64)
    try:
        assert server.url is not None, "\n".join(server.lines)
        assert httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"] == src.name
        r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert server.stop() == 0
    assert not any("llama-convert" in line for line in server.lines)


@pytest.mark.slow
def test_model_flag_mistakes_are_one_line(sources, tmp_path, home):
    src = sources[0]["gguf"]
    assert_one_line_error(gen("-m", src, "--ckpt-dir", sources[1]["gguf"]), "name different models")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size * 2 // 3])
    assert_one_line_error(gen("-m", cut), "cut.gguf is truncated")
    assert not home.exists()  # each refused before anything was written


@pytest.mark.slow
def test_llama_download_lists_and_clears_the_converted(sources, home):
    entry = resolve_checkpoint(sources[0]["q8_0"])
    size = sum(p.stat().st_size for p in entry.iterdir())
    listed = run("llama-download", "--list")
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if str(sources[0]["q8_0"]) in line)
    assert cache.format_bytes(size) in line and "GGUF" in line and entry.name in line
    cleared = run("llama-download", "--clear-converted")
    assert cleared.returncode == 0, cleared.stderr
    assert cleared.stdout.strip() == f"removed 1 converted checkpoint from {home / 'converted'}, freeing {cache.format_bytes(size)}"
    assert not entry.exists()


@pytest.fixture(scope="module")
def real_gguf():
    """The default model's GGUF in the real $LLAMA_HOME (fetched if missing): module fixtures are set up
    before the function-scoped `home` moves LLAMA_HOME."""
    from llama.convert.fetch import default_model_gguf

    path = default_model_gguf(fetch=True)
    assert path.is_relative_to(REAL_HOME)
    return path


@pytest.mark.slow
def test_the_default_models_gguf_runs_directly(real_gguf, home):
    """The real file: a 98 MB Q4_1 GGUF with a byte-level BPE vocabulary, whose header (1.8 MB) and data
    are keyed by samples, not whole."""
    args = ["--prompt", "The capital of France is", "--temperature", "0", "--max-gen-len", "6", "--json"]
    first = run("llama-generate", "-m", real_gguf, *args)
    assert first.returncode == 0, first.stderr
    assert "Paris" in json.loads(first.stdout)["text"]
    (entry,) = [p for p in (home / "converted").iterdir() if p.name != ".locks"]
    assert json.loads((entry / "quantization.json").read_text())  # its Q4_1 blocks kept as stored
    # Its Q8_0 embedding too: the weights take exactly the GGUF's tensor bytes and those of the output layer, which
    # Meta's layout stores apart from the embedding it is tied to. The files around them (torch.save's records of
    # 695 tensors, the tokenizer's JSON, the manifest) take 3.6 kB more than the GGUF's header, 0.003%.
    import gguf

    weights = load_shard(entry / "consolidated.00.pth")
    assert weights["tok_embeddings.weight"].dtype == torch.int8
    output = weights["output.weight"].nbytes + weights["output.scales"].nbytes
    in_gguf = sum(int(t.n_bytes) for t in gguf.GGUFReader(real_gguf).tensors)
    assert sum(t.nbytes for t in weights.values()) == in_gguf + output
    assert sum(f.stat().st_size for f in entry.iterdir()) <= (real_gguf.stat().st_size + output) * 1.0001
    before = snapshot(entry)
    again = run("llama-generate", "-m", real_gguf, *args)
    assert again.returncode == 0 and json.loads(again.stdout)["tokens"] == json.loads(first.stdout)["tokens"]
    assert "llama-convert" not in again.stderr and snapshot(entry) == before
