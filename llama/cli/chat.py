"""llama-chat: an interactive chat in the terminal, with history, streaming replies and the KV-cache switch."""

import sys
import time
from typing import List, Optional

from llama.chat_format import Message, has_special_tags
from llama.cli.common import fail, run
from llama.cli.loading import build_from_flags, is_main_rank
from llama.cli.streaming import TextStream
from llama.generation import check_sampling

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
    if llama.world_size > 1:
        import torch.distributed as dist

        box = [line]
        dist.broadcast_object_list(box, src=0)
        line = box[0]
    return line


def main(
    ckpt_dir: str = None,
    tokenizer_path: str = None,
    system: str = None,
    no_kv_cache: bool = False,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_gen_len: int = 512,
    max_seq_len: int = 2048,
    seed: int = 1,
    device: str = None,
    dtype: str = None,
    stats: bool = False,
    compile: bool = False,
    quantize: str = None,
):
    """Chat with a LLaMA model in the terminal.

    Each reply streams as it is generated. The whole conversation is sent to the model every turn, in the
    model's chat format, until it no longer fits in --max-seq-len (then /reset).

    Args:
        ckpt_dir: checkpoint directory in Meta's layout; default: the default model, fetched on first use.
        tokenizer_path: tokenizer file; default: the one in (or beside) the checkpoint directory.
        system: a system prompt that starts the conversation (and survives /reset).
        no_kv_cache: feed the whole prefix every step instead of caching keys and values. Same replies, slower.
        temperature: sampling temperature; 0 is greedy.
        top_p: nucleus-sampling threshold, in (0, 1].
        max_gen_len: the most tokens in one reply.
        max_seq_len: the most tokens the conversation plus a reply may use.
        seed: seed of the sampler.
        device: cpu, cuda or cuda:N; default CUDA when present, else CPU.
        dtype: float32, bfloat16 or float16; default bf16 on CUDA, float32 on CPU.
        stats: after each reply, print its prefill time and decode tokens/s to stderr.
        compile: compile the decode step with torch.compile before the chat starts: slower to start,
            faster replies. Needs a C++ compiler on the CPU.
        quantize: int8 or int4: hold every linear layer's weights quantized as they load (int8 per output
            channel, int4 in groups of 32), for a smaller and faster model; a checkpoint stored quantized
            loads as stored without it.
    """
    if max_gen_len < 1:
        fail(f"--max-gen-len must be at least 1, not {max_gen_len}")
    check_sampling(temperature, top_p, max_gen_len)
    llama = build_from_flags(ckpt_dir, tokenizer_path, max_seq_len, 1, seed, device, dtype, compile, quantize)
    main_rank = is_main_rank(llama)
    start: List[Message] = [{"role": "system", "content": str(system)}] if system else []
    dialog: List[Message] = list(start)
    if main_rank and sys.stdin.isatty():
        print(HELP, file=sys.stderr)

    while True:
        line = _read_line(llama)
        if line is None or line.strip() == "/exit":
            if main_rank and sys.stdin.isatty():
                print(file=sys.stderr)
            return
        if line.strip() == "/reset":
            dialog = list(start)
            if main_rank:
                print("(history cleared)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        candidate = dialog + [{"role": "user", "content": line}]
        if has_special_tags(candidate, llama.tokenizer.chat_format):
            if main_rank:
                print("(messages may not contain the chat format's own tags, such as [INST] or <|im_start|>)",
                      file=sys.stderr)
            continue
        prompt = llama.dialog_tokens(candidate)
        room = max_seq_len - len(prompt)
        if room < 1:
            if main_rank:
                print(f"(the conversation is {len(prompt)} tokens, which fills --max-seq-len {max_seq_len}; "
                      "/reset to start over)", file=sys.stderr)
            continue

        stream = TextStream(llama.tokenizer, [], sys.stdout) if main_rank else None
        times: List[float] = []

        def on_step(pos, next_tokens):
            times.append(time.perf_counter())
            if stream is not None:
                stream.push(next_tokens[0].item())

        t0 = time.perf_counter()
        (reply_tokens,), _ = llama.generate([prompt], min(max_gen_len, room), temperature, top_p,
                                           kv_cache=not no_kv_cache, on_step=on_step)
        reply = llama.tokenizer.decode(reply_tokens)
        if stream is not None:
            stream.finish(reply_tokens)
            if stats and times:
                rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
                print(f"(prompt {len(prompt)} tokens, prefill {1000 * (times[0] - t0):.0f} ms, "
                      f"{rate:.1f} tokens/s, kv cache {'on' if not no_kv_cache else 'off'})", file=sys.stderr)
        dialog = candidate + [{"role": "assistant", "content": reply}]


def cli() -> None:
    run(main, "llama-chat", raw_string_flags=("--system",))


if __name__ == "__main__":
    cli()
