"""llama-chat: an interactive chat in the terminal, with history, streaming replies and the KV-cache switch."""

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

from llama.dialog import has_special_tags
from llama.cli.common import as_flags, fail, run
from llama.cli.flags import STRUCTURED_RAW_FLAGS, with_model_flags
from llama.cli.loading import (build_from_flags, check_draft_flags, check_grammar, controls_from_flags,
                               grammar_from_flags, is_main_rank, speculation_from_flags)
from llama.cli.streaming import TextStream
from llama.chat.conversation import Conversation
from llama.errors import LlamaError
from llama.sampling import check_sampling
from llama.speculative import DEFAULT_DRAFT_TOKENS
from llama.io.prompt_cache import PromptCacheError, check_writable
from llama.kv_cache import describe_kv_cache
from llama.run_plan import ModelFlags

HELP = "Type a message and press Enter. /reset clears the history; Ctrl-D (or /exit) leaves."


def _read_line(llama) -> Optional[str]:
    """The user's next line (None at end of input); under torchrun rank 0 reads and the others receive it."""
    line = None
    if is_main_rank(llama):
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            line = None
        except UnicodeDecodeError:
            fail("the input is not UTF-8 text")
    if llama.info.world_size > 1:
        import torch.distributed as dist

        box = [line]
        dist.broadcast_object_list(box, src=0)
        line = box[0]
    return line


@with_model_flags
def main(
    flags: ModelFlags = None,
    system: str = None,
    no_kv_cache: bool = False,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_gen_len: int = 512,
    max_seq_len: int = 2048,
    seed: int = 1,
    stats: bool = False,
    session: str = None,
    speculate: str = None,
    draft_model: str = None,
    draft_quantize: str = None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    repeat_penalty: float = 1.0,
    repeat_last_n: int = 64,
    top_k: int = 0,
    min_p: float = 0.0,
    json_schema=None,
    grammar: str = None,
):
    """Chat with a LLaMA model in the terminal.

    Each reply streams as it is generated. Every turn sends the whole conversation in the model's chat
    format, but the KV cache is kept between turns, so only the tokens after what it already holds (the
    new message, mostly) are fed to the model. When the conversation plus a reply of --max-gen-len tokens
    no longer fits in --max-seq-len, the oldest exchanges are dropped (the system prompt stays), with a
    note on stderr.

    Args:
        <model flags>
        <kv cache dtype flag>
        system: a system prompt that starts the conversation (and survives /reset).
        no_kv_cache: feed the whole prefix every step instead of caching keys and values. Same replies, slower.
        temperature: sampling temperature; 0 is greedy.
        top_p: nucleus-sampling threshold, in (0, 1].
        max_gen_len: the most tokens in one reply.
        max_seq_len: the most tokens the conversation plus a reply may use.
        seed: seed of the sampler.
        stats: after each reply, print to stderr the prompt tokens reused from the cache and prefilled,
            the prefill time, the decode tokens/s, the KV cache's dtype and bytes a token, and with --speculate
            the drafted tokens kept.
        compile: compile the decode step even where the default would not: on a GPU (torch.compile,
            minutes per process) and for --no-kv-cache's steps. The default, with neither flag: on the CPU the
            one-token step with the cache is compiled ahead of time, once per model shape and batch size
            (about 40 s for the default model on 2 cores, with a progress line), stored under $LLAMA_HOME
            and loaded in milliseconds by every later chat; about 3 times the eager speed (docs/benchmarks.md).
            Without a C++ compiler it runs eagerly, with a note.
        no_compile: run every step eagerly, as the plain reference model does.
        session: a file that keeps the conversation and its KV cache: resumed from it (its messages, system
            prompt included) when it exists and belongs to this model, saved to it after every reply. A file
            from another model, or damaged, is reported in one line and replaced.
        <speculation flags>
        <sampling flags>
        <structured output flags>
    """
    if max_gen_len < 1:
        fail(f"--max-gen-len must be at least 1, not {max_gen_len}")
    check_sampling(temperature, top_p, max_gen_len)
    check_draft_flags(speculate, draft_model, draft_quantize, draft_tokens, kv_cache=not no_kv_cache)
    controls = controls_from_flags(repeat_penalty, repeat_last_n, top_k, min_p,
                                   speculating=speculate is not None or draft_model is not None)
    constraint = grammar_from_flags(json_schema, grammar, speculating=speculate is not None or draft_model is not None)
    if session is not None and no_kv_cache:
        fail("--session keeps the KV cache with the conversation; it cannot be used with --no-kv-cache")
    if session is not None:
        check_writable(Path(str(session)))
    flags = replace(flags, max_seq_len=max_seq_len, max_batch_size=1, seed=seed)
    llama = build_from_flags(flags)
    check_grammar(constraint, llama)
    if session is not None and llama.info.world_size > 1:
        fail("--session runs in one process, not under torchrun")
    main_rank = is_main_rank(llama)
    kv = "off" if no_kv_cache else \
        f"on, {describe_kv_cache(llama.model.kv_cache_dtype, llama.model.kv_cache_nbytes(1, 1))}"
    drafter = speculation_from_flags(llama, flags, speculate, draft_model, draft_quantize, draft_tokens)
    chat = Conversation(llama, str(system) if system else None, max_gen_len, kv_cache=not no_kv_cache,
                        speculate=drafter, draft_tokens=draft_tokens)
    if session is not None and Path(session).exists():
        try:
            n = chat.resume(Path(session))
            print(f"(resumed {n} messages and {len(chat.session.tokens)} cached tokens from {session})",
                  file=sys.stderr)
            if system and n and chat.start != [{"role": "system", "content": str(system)}]:
                print("(the resumed conversation keeps its own system prompt; --system is not used)", file=sys.stderr)
        except PromptCacheError as e:
            print(f"note: {as_flags(str(e))}; starting a new conversation, which will replace it", file=sys.stderr)
    if main_rank and sys.stdin.isatty():
        print(HELP, file=sys.stderr)

    while True:
        line = _read_line(llama)
        if line is None or line.strip() == "/exit":
            if main_rank and sys.stdin.isatty():
                print(file=sys.stderr)
            return
        if line.strip() == "/reset":
            chat.reset()
            if main_rank:
                print("(history cleared)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        if has_special_tags(chat.dialog + [{"role": "user", "content": line}], llama.tokenizer.chat_format):
            if main_rank:
                print("(messages may not contain the chat format's own tags, such as [INST] or <|im_start|>)",
                      file=sys.stderr)
            continue
        try:
            turn = chat.prepare(line)
        except LlamaError as e:
            if main_rank:
                print(f"({as_flags(str(e))})", file=sys.stderr)
            continue
        if turn.dropped and main_rank:
            print(f"(the conversation no longer fits --max-seq-len {max_seq_len}: dropped the oldest "
                  f"{turn.dropped} exchange{'s' if turn.dropped > 1 else ''})", file=sys.stderr)
        if turn.max_gen_len < max_gen_len and main_rank:
            print(f"(this message leaves room for a reply of only {turn.max_gen_len} tokens in --max-seq-len "
                  f"{max_seq_len}; --max-gen-len asks for {max_gen_len})", file=sys.stderr)

        stream = TextStream(llama.tokenizer, [], sys.stdout) if main_rank else None
        times: List[float] = []

        def on_step(pos, next_tokens):
            times.append(time.perf_counter())
            if stream is not None:
                stream.push(next_tokens[0].item())

        t0 = time.perf_counter()
        reply = chat.respond(turn, temperature, top_p, on_step=on_step, controls=controls, grammar=constraint)
        if stream is not None:
            stream.finish(reply.tokens)
            if stats and times:
                rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
                print(f"(prompt {len(turn.prompt)} tokens: {reply.reused} reused from the cache, {reply.prefilled} "
                      f"prefilled in {1000 * (times[0] - t0):.0f} ms; {rate:.1f} tokens/s; "
                      f"kv cache {kv}"
                      + (f"; speculation: {llama.last_speculation.describe()}" if drafter is not None else "") + ")",
                      file=sys.stderr)
        if session is not None:
            chat.save(Path(session))


def cli() -> None:
    run(main, "llama-chat", raw_string_flags=("--system",) + STRUCTURED_RAW_FLAGS)


if __name__ == "__main__":
    cli()
