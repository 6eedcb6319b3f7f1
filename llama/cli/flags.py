"""The flags every command that loads a model shares, and their help text, written once."""

import functools
import inspect
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, Optional

from llama.cli.common import fail
from llama.errors import LlamaError
from llama.run_plan import ModelFlags

# In the order a command's help lists them where its signature does not say otherwise.
MODEL_FLAGS = {
    "ckpt_dir": "a checkpoint directory in Meta's layout (params.json, consolidated.NN.pth), a .gguf file or a "
                "Hugging Face LLaMA folder (converted once into $LLAMA_HOME/converted); default: the default model, "
                "fetched on first use.",
    "tokenizer_path": "tokenizer file; default: the one in (or beside) the checkpoint directory.",
    "device": "cpu, cuda or cuda:N; default CUDA when present, else CPU.",
    "dtype": "float32, bfloat16 or float16; default bf16 on CUDA, float32 on CPU.",
    "quantize": "int8 or int4: hold every linear layer's weights quantized as they load (int8 per output channel, "
                "int4 in groups of 32), for a smaller and faster model; a checkpoint stored quantized loads as stored "
                "without it.",
    "quant_kernels": "what quantized weights multiply with on the CPU: integer (the default; activations rounded to "
                     "int8 blocks too, integer dot products as llama.cpp does: fast) or exact (the activations as "
                     "they are times the dequantized weights: cached and uncached runs agree to float rounding).",
    "model": "the same as --ckpt-dir, by llama.cpp's name (-m FILE).",
}
MARKER = "<model flags>"
# The speculative-decoding flags of llama-generate, llama-chat and llama-server, where their docstrings say so.
SPECULATION_FLAGS = {
    "speculate": "ngram: draft tokens by prompt lookup (the tokens that followed the latest earlier occurrence of the "
                 "last few tokens, in the prompt or the output so far) and check each draft in one step: at "
                 "temperature 0 exactly the plain decode's text, faster where the output repeats the input "
                 "(summaries, edits, code); above it the same distribution. Needs the KV cache.",
    "draft_model": "draft with a second, smaller model that shares the model's tokenizer (a checkpoint directory, "
                   "GGUF or Hugging Face folder; 'default' for the default model), checked in one step as --speculate "
                   "ngram's drafts are: the same text. The model's own checkpoint with --draft-quantize int4 is a "
                   "draft model every user has.",
    "draft_quantize": "int8 or int4: quantize the draft model as it loads.",
    "draft_tokens": "the most tokens a draft holds (1-16; default 4).",
}
SPECULATION_MARKER = "<speculation flags>"
# The KV cache's dtype, on the commands that keep a cache (llama-generate, llama-chat, llama-server, llama-perplexity).
KV_CACHE_DTYPE_FLAG = {
    "kv_cache_dtype": "what the KV cache holds keys and values in: auto (the model's dtype, the default), float32, "
                      "bfloat16, or int8 (blocks of 32 along each head with a float32 scale each: about 3.6 times "
                      "the positions of float32 in the same memory). The run without the cache rounds its keys and "
                      "values the same way: bit for bit the same on the integer kernels, within a rounding step "
                      "elsewhere. On the CPU the compiled decode step takes "
                      "such a cache too; on a GPU a dtype other than the model's runs the decode step eagerly, and "
                      "--compile refuses it.",
}
KV_CACHE_DTYPE_MARKER = "<kv cache dtype flag>"
# What changes the logits before temperature and top_p, on llama-generate and llama-chat (llama/sampling.py).
SAMPLING_FLAGS = {
    "repeat_penalty": "llama.cpp's repeat penalty: each distinct token among the last --repeat-last-n (prompt "
                      "included) has a positive logit divided by it and a negative one multiplied by it; 1 (the "
                      "default) is none, 1.1 a usual value.",
    "repeat_last_n": "how many of the last tokens --repeat-penalty looks at (default 64; 0: none, -1: all).",
    "top_k": "sample only from the k likeliest tokens (default 0: all).",
    "min_p": "sample only from tokens at least this fraction as likely as the likeliest (default 0: all; 0.05 a "
             "usual value). The same text with and without the KV cache under each of these.",
}
SAMPLING_MARKER = "<sampling flags>"
# What the generated text must be, on llama-generate and llama-chat (llama/constraint.py; the `structured` extra).
STRUCTURED_FLAGS = {
    "json_schema": "a JSON schema (a file, or the JSON itself) every reply keeps to: tokens that would break it are "
                   "never chosen, and a reply ends when the JSON is complete. Needs pip install "
                   "\"llama-kv[structured]\". The same text with and without the KV cache.",
    "grammar": "a file with a grammar every reply keeps to, in llguidance's Lark form (start: ...) or llama.cpp's "
               "GBNF (root ::= ...).",
}
STRUCTURED_MARKER = "<structured output flags>"
# Taken as typed: fire would read a schema's JSON as a Python literal, its `false` and `null` as the strings "false"
# and "null".
STRUCTURED_RAW_FLAGS = ("--json-schema", "--json_schema", "--grammar")


def model_flags_help(indent: int = 8, width: int = 116, flags: Optional[Dict[str, str]] = None) -> str:
    """The shared flags (`MODEL_FLAGS` unless `flags` are given) as entries of a docstring's Args section, the form
    fire reads its help from."""
    lines = []
    for name, text in (MODEL_FLAGS if flags is None else flags).items():
        lines += textwrap.wrap(f"{name}: {text}", width=width, initial_indent=" " * indent,
                               subsequent_indent=" " * (indent + 4), break_on_hyphens=False)
    return "\n".join(lines)


# The flags that make a command's `ModelFlags`, with their defaults on the command line, in the order a main's help lists
# them where its `flags` parameter stands.
COMMAND_MODEL_FLAGS = {"ckpt_dir": None, "tokenizer_path": None, "device": None, "dtype": None, "quantize": None,
                       "quant_kernels": "integer", "model": None, "kv_cache_dtype": "auto", "compile": False,
                       "no_compile": False}


def with_model_flags(main: Callable) -> Callable:
    """Write the shared flags' help where `main`'s docstring says `<model flags>` (and `<speculation flags>`,
    `<kv cache dtype flag>`, `<sampling flags>` or `<structured output flags>`, where it does); fire shows it as `main`'s own.

    A `main` with a `flags` parameter takes the model flags as one `ModelFlags`: fire sees `COMMAND_MODEL_FLAGS` in its
    place, and `main` gets them made into one (`model_flags`)."""
    doc = main.__doc__
    assert doc is not None and MARKER in doc, f"{main.__module__}.main's docstring has no {MARKER} line"
    for marker, flags in ((MARKER, MODEL_FLAGS), (SPECULATION_MARKER, SPECULATION_FLAGS),
                          (KV_CACHE_DTYPE_MARKER, KV_CACHE_DTYPE_FLAG), (SAMPLING_MARKER, SAMPLING_FLAGS),
                          (STRUCTURED_MARKER, STRUCTURED_FLAGS)):
        line = next((l for l in doc.splitlines() if marker in l), None)
        if line is not None:
            doc = doc.replace(line, model_flags_help(indent=len(line) - len(line.lstrip()), flags=flags))
    main.__doc__ = one_line_args(doc)
    signature = inspect.signature(main)
    if "flags" not in signature.parameters:
        return main
    params = []
    for param in signature.parameters.values():
        if param.name == "flags":
            params += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                         annotation=bool if isinstance(default, bool) else str)
                       for name, default in COMMAND_MODEL_FLAGS.items()]
        else:
            params.append(param)
    command = signature.replace(parameters=params)

    @functools.wraps(main)
    def taking_flags(*args, **kwargs):
        given = command.bind(*args, **kwargs)
        given.apply_defaults()
        values = dict(given.arguments)
        flags = model_flags(**{name: values.pop(name) for name in COMMAND_MODEL_FLAGS},
                            no_kv_cache=values.get("no_kv_cache", False))
        return main(flags=flags, **values)

    taking_flags.__signature__ = command
    return taking_flags


def model_flags(ckpt_dir, tokenizer_path, device, dtype, quantize, quant_kernels, model, kv_cache_dtype, compile,
                no_compile, no_kv_cache: bool = False) -> ModelFlags:
    """The `ModelFlags` a command's flags ask for, or a one-line error for one that is not among its choices.

    --compile and --no-compile make `compile` True or False; with neither it stays None, what $LLAMA_COMPILE says
    (unset: "auto", the stored compiled step wherever it can be had), except that with --no-kv-cache "auto" compiles
    nothing (the stored step serves only cached steps)."""
    if compile and no_compile:
        fail("--compile and --no-compile contradict each other; give one")
    flags = ModelFlags(ckpt_dir=model_flag(ckpt_dir, model),
                       tokenizer_path=None if tokenizer_path is None else str(tokenizer_path), device=device,
                       dtype=dtype, compile=bool(compile) if compile or no_compile else None, quantize=quantize,
                       quant_kernels=str(quant_kernels), kv_cache_dtype=kv_cache_dtype)
    try:
        default = flags.checked().compile
    except LlamaError as e:
        fail(str(e))
    return replace(flags, compile=False) if no_kv_cache and default == "auto" else flags


def model_flag(ckpt_dir: Optional[str], model: Optional[str]) -> Optional[str]:
    """The model a command was given: --ckpt-dir, or -m / --model (llama.cpp's name for the same flag)."""
    if model is not None and ckpt_dir is not None and \
            Path(str(model)).expanduser().resolve() != Path(str(ckpt_dir)).expanduser().resolve():
        fail(f"--ckpt-dir {ckpt_dir} and -m/--model {model} name different models; give one of them")
    chosen = model if model is not None else ckpt_dir
    return None if chosen is None else str(chosen)


def one_line_args(doc: str) -> str:
    """`doc` with each entry of its Args section on one line. fire reads a wrapped entry's later lines one at a time and
    drops whatever follows a colon on them (a line such as "folder; default: the default model" loses its end, or
    becomes an argument of its own), so each flag's help would show cut; it prints an entry's lines joined anyway."""
    lines, out, in_args, indent = doc.splitlines(), [], False, None
    for line in lines:
        stripped = line.strip()
        if in_args and stripped:
            depth = len(line) - len(line.lstrip())
            indent = depth if indent is None else indent
            if depth > indent and out:
                out[-1] += " " + stripped
                continue
            if depth < indent:
                in_args = False
        elif in_args:
            in_args = False
        if stripped == "Args:":
            in_args, indent = True, None
        out.append(line)
    return "\n".join(out)
