"""What several test files share: tiny random checkpoints, building them, and running the commands.

Test files import these names (`from helpers import build, generate`); conftest.py holds only the fixtures.

Every tiny model's weights come from a seed. `LLAMA_TEST_SEED=N` adds N to every seed, so a run draws other
weights, as a newer torch's random number generation does: a test that passes only for the weights one torch
happens to draw shows itself then.
"""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import numpy as np
import torch

from llama import Llama
from llama.io.checkpoint import params_dict, save_checkpoint
from llama.model import ModelArgs
from llama.io.random_weights import random_state_dict, write_random_checkpoint
from llama.server.engine import Delta, Done, Failed
from llama.tokenizer import Tokenizer

import commands

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_TOKENIZER = REPO / "tokenizer.model.example"
# The console scripts installed beside this Python, or where PATH finds them when they are not (`pip install --target
# DIR` puts them in DIR/bin, as scripts/gpu_check.sh does to leave the GPU machine's Python as it was).
BIN = Path(sys.executable).parent
if not (BIN / "llama-generate").exists() and shutil.which("llama-generate"):
    BIN = Path(shutil.which("llama-generate")).parent
# torchrun as a module of this Python: a virtual environment that takes torch from the system's site-packages
# has no torchrun script of its own.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
PROMPT = "I believe the meaning of life is"

# Multi-head, grouped-query and multi-query attention: n_heads / n_kv_heads = 1, 4 and 4 (down to 1 KV head).
ATTENTION_SHAPES = {
    "mha": {"n_heads": 4, "n_kv_heads": 4},
    "gqa": {"n_heads": 8, "n_kv_heads": 2},
    "mqa": {"n_heads": 4, "n_kv_heads": 1},
}

# A large init scale makes the tiny models' next-token distributions peaked, so greedy decoding is not
# decided by near-ties that float rounding could flip.
TEST_STD = 0.1

SEED_OFFSET = int(os.environ.get("LLAMA_TEST_SEED", "0"))


def tiny_args(kind: str = "gqa", **overrides) -> ModelArgs:
    fields = dict(dim=64, n_layers=2, vocab_size=4000, multiple_of=32, norm_eps=1e-5, max_seq_len=64, max_batch_size=8)
    fields.update(ATTENTION_SHAPES[kind])
    fields.update(overrides)
    return ModelArgs(**fields)


def write_tiny(path: Path, kind: str = "gqa", num_shards: int = 1, seed: int = 0, tokenizer: Path = EXAMPLE_TOKENIZER,
               dtype: torch.dtype = torch.float32, **overrides):
    """A tiny checkpoint at `path` (float32 unless `dtype` says otherwise); returns (path, state_dict)."""
    return write_random_checkpoint(path, tiny_args(kind, **overrides), seed=seed + SEED_OFFSET, dtype=dtype,
                                   tokenizer_path=tokenizer, num_shards=num_shards, std=TEST_STD)


def write_nonstop(path: Path, seed: int = 0) -> Path:
    """A tiny grouped-query checkpoint whose greedy decoding never picks a stop token, nor another control
    token (which would print nothing).

    Tests that need a greedy run of an exact length through the commands (which, unlike `Llama.generate`,
    have no `ignore_stop`) or through Meta's `text_completion` / `chat_completion` use it, so that what
    they check does not hang on whether a random model happens to rank the end-of-sequence token first.

    The output layer's rows for the control tokens (<unk>, <s>, </s>) are zero, so their logits are exactly
    0. Rows +0.1 e_k and -0.1 e_k for every dimension k give other tokens the logits +-0.1 h_k; the final norm
    (weight 1) leaves h with a mean square of 1, so some |h_k| >= 1 and some other token's logit is at least
    0.1: a control token is never the largest. The remaining rows are the random ones.
    """
    args = tiny_args("gqa")
    state = random_state_dict(args, seed=seed + SEED_OFFSET, std=TEST_STD)
    output = state["output.weight"]  # (vocab_size, dim)
    tokenizer = Tokenizer(str(EXAMPLE_TOKENIZER))
    silent = sorted({tokenizer.sp_model.unk_id(), tokenizer.bos_id, *tokenizer.stop_ids})
    output[silent] = 0
    axes = torch.cat([torch.eye(args.dim), -torch.eye(args.dim)]) * TEST_STD  # (2 dim, dim)
    first = 1000  # ordinary pieces of the example vocabulary
    assert not set(silent) & set(range(first, first + 2 * args.dim))
    output[first:first + 2 * args.dim] = axes
    return save_checkpoint(path, params_dict(args), state, tokenizer_path=EXAMPLE_TOKENIZER)


# Qwen2.5-Instruct's chat template, as its tokenizer_config.json has it: tools in a system message, calls and results
# in the Hermes form (tests/test_chat_template.py, tests/server/test_tool_calls.py).
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == "
    "\"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def write_template_model(path: Path, chat_template: str, seed: int = 0) -> Path:
    """A tiny checkpoint with a byte-level tokenizer.json (each of the 256 bytes a token, no merges, then ChatML's
    <|endoftext|>, <|im_start|> and <|im_end|> as special tokens) whose tokenizer_config.json keeps `chat_template`,
    as llama-convert writes one for a Hugging Face folder."""
    from llama.convert.hf_tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, byte_level_tokenizer_json, tokenizer_config
    from llama.tokenizer import _byte_level_decoder

    tokens = [c for c, _ in sorted(_byte_level_decoder().items(), key=lambda item: item[1])]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    files = path.parent / f"{path.name}-tokenizer"
    files.mkdir(parents=True)
    (files / "tokenizer.json").write_bytes(byte_level_tokenizer_json(
        tokens, [], [TOKEN_NORMAL] * 256 + [TOKEN_CONTROL] * 3, None, "a test vocabulary"))
    write_random_checkpoint(path, tiny_args("gqa", vocab_size=len(tokens)), seed=seed + SEED_OFFSET,
                            tokenizer_path=files / "tokenizer.json", std=TEST_STD)
    config = tokenizer_config(tokens, None, 256, 256, False, chat_template)
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


def build(ckpt: Path, **kwargs) -> Llama:
    kwargs = {"max_seq_len": 64, "max_batch_size": 8, "device": "cpu", "dtype": "float32", **kwargs}
    return Llama.build(ckpt, **kwargs)


def run(cmd: str, *args, input: str = None, env: dict = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """A console script (`llama-generate`) or a script of this repository (`scripts/x.py`), as a user runs it."""
    if cmd.endswith(".py"):
        argv = [sys.executable, str(REPO / cmd)]
    else:
        argv = [str(BIN / cmd)]
    return commands.run(argv + [str(a) for a in args], env, input=input, timeout=timeout)


def generate(ckpt: Path, *args, **kwargs) -> subprocess.CompletedProcess:
    """llama-generate, greedy, 12 new tokens at the most, unless `args` say otherwise (later flags win)."""
    return run("llama-generate", "--ckpt-dir", ckpt, "--temperature", "0", "--max-gen-len", "12", *args, **kwargs)


def under_torchrun(nproc: int, command: str) -> List[str]:
    """The argv of a console script under torchrun with `nproc` processes."""
    return TORCHRUN + [f"--nproc_per_node={nproc}", "--no-python", str(BIN / command)]


def assert_refused_under_torchrun(result: subprocess.CompletedProcess, message: str) -> None:
    """The command failed saying `message`, and no traceback is ours (torchrun prints its own when a rank fails)."""
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    assert str(REPO / "llama") not in result.stderr


def generate_json(ckpt: Path, *args, nproc: int = 1, max_gen_len: int = 12) -> List[dict]:
    """llama-generate's JSON records (greedy, with logprobs, on the CPU), by one process or torchrun's `nproc`."""
    flags = ["--ckpt-dir", str(ckpt), "--json", "--logprobs", "--temperature", "0", "--max-gen-len", str(max_gen_len),
             "--device", "cpu", *map(str, args)]
    cmd = under_torchrun(nproc, "llama-generate") if nproc > 1 else [str(BIN / "llama-generate")]
    result = commands.run(cmd + flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return json_lines(result.stdout)


def json_lines(stdout: str) -> List[dict]:
    """One JSON object per line. Split at newlines only: a record holding the model's text may hold other line
    breaks (U+0085, U+2028), which json.dumps(ensure_ascii=False) leaves as they are and str.splitlines splits at."""
    return [json.loads(line) for line in stdout.split("\n") if line]


def chat(ckpt: Path, *args, input: str) -> subprocess.CompletedProcess:
    """llama-chat, greedy, replies of 8 tokens at the most unless `args` say otherwise; it must succeed."""
    length = [] if "--max-gen-len" in map(str, args) else ["--max-gen-len", "8"]
    result = run("llama-chat", "--ckpt-dir", ckpt, "--temperature", "0", *length, *args, input=input)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    return result


def chat_stats(stderr: str) -> List[dict]:
    """The lines `llama-chat --stats` writes after each reply, one per reply, as numbers."""
    out = []
    for line in stderr.splitlines():  # stderr holds only the command's own notes, never the model's text
        if line.startswith("(prompt "):
            prompt, rest = line[len("(prompt "):].split(" tokens: ", 1)
            reused, rest = rest.split(" reused from the cache, ", 1)
            out.append({"prompt": int(prompt), "reused": int(reused), "prefilled": int(rest.split(" prefilled")[0]),
                        "line": line})
    return out


def convert_cli(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    """The llama-convert command (or its module, where the console script is not installed)."""
    script = shutil.which("llama-convert", path=str(BIN))
    cmd = [script] if script else [sys.executable, "-m", "llama.cli.convert"]
    return commands.run(cmd + [str(a) for a in args], timeout=timeout)


def torchrun(script: Path, nproc: int, *args, env: dict = None) -> subprocess.CompletedProcess:
    """A Python script under torchrun with `nproc` processes; it must succeed."""
    cmd = TORCHRUN + [f"--nproc_per_node={nproc}", str(script), *map(str, args)]
    result = commands.run(cmd, env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """The command failed with one line on stderr, `error: ...`, holding every fragment, and no traceback."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def first_stop(tokens: List[int], stop_ids) -> int:
    """Where a row's generated tokens end: the index of the first stop token among them, or their length."""
    return next((i for i, t in enumerate(tokens) if t in stop_ids), len(tokens))


# --- quantized weights, read without the library ---------------------------------------------------------


def dequantize_stored(state: dict, prefix: str) -> torch.Tensor:
    """The float32 (out, in) weight that the quantized tensors `{prefix}weight`, `scales` (and `mins`) of a state
    dict stand for, worked out here from the on-disk format (llama/quant/format.py) rather than by the library,
    so that a test comparing a layer with it compares two independent computations.

    int8: value x scale of its group. int4: two values a byte, column 2j in the low nibble and 2j + 1 in the
    high one, each value x scale + min of its group.
    """
    weight, scales = state[prefix + "weight"], state[prefix + "scales"].double()
    if weight.dtype == torch.int8:
        values, offsets = weight.double(), torch.zeros_like(scales)
    else:
        assert weight.dtype == torch.uint8
        values = torch.stack([weight & 0x0F, weight >> 4], dim=-1).reshape(weight.shape[0], -1).double()
        offsets = state[prefix + "mins"].double()
    group = values.shape[1] // scales.shape[1]
    return (values * scales.repeat_interleave(group, dim=1) + offsets.repeat_interleave(group, dim=1)).float()


# --- a tiny transformers LLaMA, for the converters' tests ------------------------------------------------

# An intermediate size that Meta's multiple_of rule cannot give (so params.json needs hidden_dim), and a
# rope_theta and epsilon away from the defaults, so that losing any of them changes the logits.
HF_SHAPE = dict(vocab_size=4000, hidden_size=64, intermediate_size=200, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-6,
                max_position_embeddings=128)


def tiny_hf_model(tied: bool):
    """A random transformers LlamaForCausalLM of HF_SHAPE (needs transformers)."""
    import transformers

    config = transformers.LlamaConfig(**HF_SHAPE, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(SEED_OFFSET)
    model = transformers.LlamaForCausalLM(config)
    # A larger init than the default 0.02 makes the logits spread out, so a wrong permutation shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.5, 1.5)  # not all ones, so swapped norms would show
    return model.eval()


def save_hf(model, path: Path) -> Path:
    """`model` as a Hugging Face directory (safetensors) with the example tokenizer beside it."""
    model.save_pretrained(path, safe_serialization=True)
    shutil.copyfile(EXAMPLE_TOKENIZER, path / "tokenizer.model")
    return path


def permute_for_gguf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """transformers' q/k rows into the interleaved order llama.cpp's converter writes (its `permute`)."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(model, path: Path) -> Path:
    """The model as an f32 GGUF file, written the way llama.cpp's converter lays it out."""
    c = model.config
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    # The example SentencePiece vocabulary, as llama.cpp stores one.
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(EXAMPLE_TOKENIZER))
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.vocab_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.vocab_size())])
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1
             for i in range(sp.vocab_size())]
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in model.state_dict().items():
        tensor = tensor.float()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue  # llama.cpp leaves the output out of a tied model
            gname = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.(self_attn|mlp).X.weight or model.layers.N.X.weight
            gname = f"blk.{parts[2]}.{names[parts[-2]]}.weight"
            if parts[-2] == "q_proj":
                tensor = permute_for_gguf(tensor, c.num_attention_heads)
            elif parts[-2] == "k_proj":
                tensor = permute_for_gguf(tensor, c.num_key_value_heads)
        writer.add_tensor(gname, tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def uncached_in_one_pass(llama: Llama, ids: List[List[int]], cached: List[List[int]]):
    """What the uncached steps of `cached`'s greedy runs compute, in one pass without the cache: every row (its prompt
    and its tokens but the last, right-padded) from position 0, each step's logits read at the position that step
    would end at. Only on row-exact paths, where a position's logits depend neither on the positions after it (the
    mask hides them) nor on the rows beside it. Per row: (the greedy tokens, their log-probabilities)."""
    rows = [row + tokens[:-1] for row, tokens in zip(ids, cached)]
    width = max(len(row) for row in rows)
    batch = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    with torch.inference_mode():
        logprobs = torch.log_softmax(llama.model(batch, 0), dim=-1)  # (rows, width, vocab)
    out = []
    for k, (row, tokens) in enumerate(zip(ids, cached)):
        steps = logprobs[k, len(row) - 1:len(row) - 1 + len(tokens)]  # (len(tokens), vocab)
        out.append((steps.argmax(-1).tolist(), steps.gather(1, torch.tensor(tokens)[:, None])[:, 0].double()))
    return out


def without_kernels(llama: Llama) -> Llama:
    """A copy of a loaded model whose quantized layers take the exact fallback (widening the weight), as a
    torch without the private quantized kernels would run it."""
    from llama.quant.layer_plan import choose_layer_classes
    from llama.quant.linears import Int4KernelLinear, Int8KernelLinear

    model = choose_layer_classes(copy.deepcopy(llama.model), kernels=False)
    assert not any(isinstance(m, (Int8KernelLinear, Int4KernelLinear)) for m in model.modules())
    return Llama(model, llama.tokenizer, info=llama.info)


def wait_for(what: str, predicate, timeout: float = 60.0) -> None:
    """Poll `predicate` until it holds; a bound generous enough that only a hang reaches it."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


# llama-server, in process and as a subprocess, for the tests of the server and of what it serves.

KEY = "test-key-123"
SERVER_MAX_SEQ_LEN = 256


def make_engine(llama, num_blocks=64, block_size=4, parallel=8, prefill_chunk=16, kv_cache=True, **settings):
    """llama-server's serving loop over `llama` (llama/server/app.py), started, with a KV cache of `num_blocks`
    (`settings`: more of `start_engine`'s)."""
    from llama.server.app import start_engine

    return start_engine(llama, parallel=parallel, kv_cache_size=num_blocks * block_size, block_size=block_size,
                        prefill_chunk=prefill_chunk, kv_cache=kv_cache, **settings).engine


class Collector:
    """A job's events, and a way to wait for its end."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, (Done, Failed)):
            self.done.set()

    def texts(self, n=1):
        out = [""] * n
        for e in self.events:
            if isinstance(e, Delta):
                out[e.index] += e.text
        return out

    def finish_reasons(self, n=1):
        out = [None] * n
        for e in self.events:
            if isinstance(e, Delta) and e.finish_reason:
                out[e.index] = e.finish_reason
        return out

    def usage(self) -> Done:
        return next(e for e in self.events if isinstance(e, Done))


def run_jobs(engine, jobs):
    collectors = []
    for job in jobs:
        job.emit = Collector()
        collectors.append(job.emit)
        engine.submit(job)
    for c in collectors:
        assert c.done.wait(120), "a job did not finish"
        assert not any(isinstance(e, Failed) for e in c.events), c.events
    return collectors


def solo(llama, prompt, max_tokens, **kwargs):
    tokens, logprobs = llama.generate([prompt], max_tokens, temperature=kwargs.pop("temperature", 0), **kwargs)
    return tokens[0], (logprobs[0] if logprobs else None)


def prompts(llama):
    """Eight prompts: some share a long prefix (a system prompt), one is a prefix of another, lengths differ."""
    enc = lambda s: llama.tokenizer.encode(s, bos=True, eos=False)  # noqa: E731
    system = "You are a careful assistant. Answer the question in one short sentence, then stop. "
    return [enc(system + q) for q in ("What is a list?", "What is a dict?", "Why is the sky blue?", "")] + [
        enc("def fibonacci(n):"), enc("A"), enc("The capital of France is"), enc("The capital of France is Paris, and")]


class Server:
    """A llama-server subprocess, its URL once it is ready, and the lines it has logged."""

    def __init__(self, ckpt, *flags, max_seq_len: int = SERVER_MAX_SEQ_LEN,
                 launcher=(sys.executable, "-m", "llama.cli.server"), env=None):
        model = ["--ckpt-dir", str(ckpt)] if ckpt is not None else []  # None: the flags name it
        cmd = [*launcher, *model, "--port", "0", "--max-seq-len", str(max_seq_len), *map(str, flags)]
        # Without OMP_WAIT_POLICY, which conftest.py sets for the workers: the server chooses its own spin, as it ships.
        inherited = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        env = {**inherited, **commands.COMMAND_ENV, "PYTHONPATH": str(REPO), "LLAMA_API_KEY": "", **(env or {})}
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
        self.lines, self.ready = [], threading.Event()
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(180):
            self.proc.kill()
            raise AssertionError("the server did not start:\n" + "\n".join(self.lines))

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if "listening on " in line and self.url is None:
                self.url = line.split("listening on ")[1].split()[0]
                self.ready.set()
        self.ready.set()

    def client(self, key=KEY):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self, sig=signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def metrics(self):
        import httpx

        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


class Always:
    """Drafts at every step: the tokens that followed the latest earlier occurrence of the last token, else the
    last token again and again (a draft that is mostly wrong, which the check must reject)."""

    def draft(self, tokens, k):
        last = tokens[-1]
        for i in range(len(tokens) - 2, -1, -1):
            if tokens[i] == last:
                follow = tokens[i + 1 : i + 1 + k]
                return follow + [last] * (k - len(follow))
        return [last] * k


# JSON schemas for structured outputs (tests/test_constraint.py, tests/server/test_structured.py), each one finite: every string, array and number is bounded, so any path through it ends, whatever a random model
# picks (the whitespace between tokens is bounded too: llama/constraint.py's JSON_WHITESPACE).
FINITE_SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "active"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["name", "id"],
                                       "properties": {"name": {"type": "string", "maxLength": 6},
                                                      "id": {"type": "integer", "minimum": 0, "maximum": 999}}},
                              "active": {"type": "boolean"}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["answer"],
             "properties": {"answer": {"enum": ["yes", "no", "unsure"]}}},
    "array": {"type": "array", "items": {"enum": [1, 2, 3, "x"]}, "minItems": 1, "maxItems": 4},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["n", "price"],
                "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
                               "price": {"enum": [0.5, 1.25, 100]}}},
}
