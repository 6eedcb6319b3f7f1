"""llama-generate: continue prompts from the command line, with the KV cache on or off."""

import json as jsonlib
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

from llama.cli.common import as_flags, fail, run, seconds_since_start, whole_numbers
from llama.cli.flags import STRUCTURED_RAW_FLAGS, with_model_flags
from llama.cli.loading import (build_from_flags, check_draft_flags, check_grammar, controls_from_flags,
                               describe_speculation, grammar_from_flags, is_main_rank, speculation_from_flags)
from llama.cli.streaming import TextStream
from llama.sampling import check_sampling
from llama.speculative import DEFAULT_DRAFT_TOKENS
from llama.io.identity import describe_model, model_identity
from llama.kv_cache import describe_kv_cache
from llama.io.prompt_cache import PromptCacheError, check_writable, load_prompt_cache, restore, save_prompt_cache
from llama.nn.session import Session
from llama.run_plan import ModelFlags
from llama.runtime.threads import describe_threads


def read_prompts(prompt: Optional[str], prompts_file: Optional[str]) -> List[str]:
    """The prompts to run: one from --prompt, or one per line of --prompts-file."""
    if (prompt is None) == (prompts_file is None):
        fail("give exactly one of --prompt TEXT or --prompts-file FILE")
    if prompt is not None:
        prompts = [str(prompt)]
    else:
        path = Path(str(prompts_file))
        try:
            text = path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            fail(f"prompts file {path} does not exist")
        except UnicodeDecodeError as e:
            fail(f"prompts file {path} is not UTF-8 text (byte {e.start} is invalid)")
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            fail(f"prompts file {path} holds no prompts (one per line)")
    if any(not p.strip() for p in prompts):
        fail("the prompt is empty")
    return prompts


@with_model_flags
def main(
    prompt: str = None,
    prompts_file: str = None,
    flags: ModelFlags = None,
    echo: bool = False,
    no_kv_cache: bool = False,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_gen_len: int = 128,
    max_seq_len: int = 2048,
    max_batch_size: int = 8,
    seed: int = 1,
    logprobs: bool = False,
    json: bool = False,
    stats: bool = False,
    stream: bool = None,
    truncate: bool = False,
    prompt_cache: str = None,
    precompile=False,
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
    """Continue text prompts with a LLaMA model.

    Examples:
        llama-generate --prompt "The capital of France is" --echo
        llama-generate --prompt "The capital of France is" --no-kv-cache --stats
        llama-generate --prompts-file prompts.txt --json --temperature 0
        llama-generate --prompt "$(cat long-document.txt) Summary:" --prompt-cache doc.kv
        llama-generate --precompile --quantize int8
        llama-generate --prompt "$(cat code.py) # The same code with type hints:" --speculate ngram --temperature 0

    Args:
        prompt: the text to continue.
        prompts_file: a UTF-8 file with one prompt per line (instead of --prompt); they run as one batch.
        <model flags>
        <kv cache dtype flag>
        echo: print the prompt before its continuation.
        no_kv_cache: feed the whole prefix every step instead of caching keys and values. Same text, slower.
        temperature: sampling temperature; 0 is greedy.
        top_p: nucleus-sampling threshold, in (0, 1].
        max_gen_len: the most new tokens per prompt.
        max_seq_len: the most tokens (prompt plus generation) a run may use.
        max_batch_size: the most prompts in one run.
        seed: seed of the sampler; the same seed gives the same text.
        logprobs: also report each generated token's log-probability (with --json or --stats).
        json: print one JSON object per prompt (text, token ids, logprobs if asked, timings).
        stats: print prompt tokens, prefill time, decode tokens/s, the KV cache's dtype, bytes a token and bytes
            in all to stderr, and the seconds each phase of the run took: start-up (Python and the imports), loading
            (model, weights, tokenizer), prefill (to the first new token) and decode.
        stream: print text as it is generated; default: when printing one prompt to a terminal.
        truncate: cut prompts that are too long from the left (keeping bos) so that max_gen_len new
            tokens fit in max_seq_len, but never to less than half of max_seq_len; without it a prompt
            that is too long is an error.
        compile: compile the decode step even where the default would not: on a GPU (torch.compile,
            minutes per process) and for --no-kv-cache's steps. The default, with neither flag: on the CPU the
            one-token step with the cache is compiled ahead of time, once per model shape and batch size
            (about 40 s for the default model on 2 cores, with a progress line), stored under $LLAMA_HOME
            and loaded in milliseconds by every later run; about 3 times the eager speed (docs/benchmarks.md).
            Without a C++ compiler it runs eagerly, with a note.
        no_compile: run every step eagerly, as the plain reference model does.
        prompt_cache: a file of the prompt's keys and values. When it exists and belongs to this model, the
            prompt's tokens after the longest prefix it holds are all that is fed; the prompt's keys and
            values are then saved there for the next run. Same text as without it; one prompt only.
        precompile: build the compiled decode step this model and these flags will use, store it, and exit
            without generating, so that no later run pays for it (llama-chat uses the same one). Alone, for
            one prompt at a time; with batch sizes (--precompile 1,4), for each: a --prompts-file of N
            prompts runs at batch size N.
        <speculation flags>
        <sampling flags>
        <structured output flags>
    """
    import_s = seconds_since_start()
    flags = replace(flags, max_seq_len=max_seq_len, max_batch_size=max_batch_size, seed=seed)
    if precompile is not False:
        if prompt is not None or prompts_file is not None:
            fail("--precompile builds the compiled decode step and exits; give it no prompt")
        if flags.compile is False or no_kv_cache:
            fail("--precompile builds the compiled decode step with the KV cache; leave out --no-compile and --no-kv-cache")
        sizes = batch_sizes(precompile)
        llama = build_from_flags(replace(flags, max_batch_size=max(max_batch_size, *sizes), compile="auto",
                                         compile_batch_size=sizes[0]))
        store_compiled_steps(llama, sizes)
        return
    prompts = read_prompts(prompt, prompts_file)
    if max_gen_len < 1:
        fail(f"--max-gen-len must be at least 1, not {max_gen_len}")
    check_sampling(temperature, top_p, max_gen_len)
    check_draft_flags(speculate, draft_model, draft_quantize, draft_tokens, kv_cache=not no_kv_cache)
    controls = controls_from_flags(repeat_penalty, repeat_last_n, top_k, min_p,
                                   speculating=speculate is not None or draft_model is not None)
    constraint = grammar_from_flags(json_schema, grammar, speculating=speculate is not None or draft_model is not None)
    if len(prompts) > max_batch_size:
        fail(f"{len(prompts)} prompts exceed --max-batch-size {max_batch_size}; raise it or split the file")

    if prompt_cache is not None and (len(prompts) > 1 or no_kv_cache):
        fail("--prompt-cache keeps the KV cache of one prompt: give one --prompt, without --no-kv-cache")
    if prompt_cache is not None:
        check_writable(Path(str(prompt_cache)))

    load_start = time.perf_counter()
    llama = build_from_flags(replace(flags, compile_batch_size=len(prompts)))
    drafter = speculation_from_flags(llama, flags, speculate, draft_model, draft_quantize, draft_tokens)
    load_s = time.perf_counter() - load_start
    check_grammar(constraint, llama)
    if prompt_cache is not None and llama.info.world_size > 1:
        fail("--prompt-cache runs in one process, not under torchrun")
    tokenizer = llama.tokenizer
    prompt_tokens = [tokenizer.encode(p, bos=True, eos=False) for p in prompts]
    main_rank = is_main_rank(llama)
    if truncate:
        keep = max(max_seq_len - max_gen_len, max_seq_len // 2, 1)
        for i, toks in enumerate(prompt_tokens):
            if len(toks) > keep:
                cut = [toks[0]] + toks[len(toks) - keep + 1:] if toks[0] == tokenizer.bos_id else toks[-keep:]
                if main_rank:
                    print(f"note: prompt {i + 1} cut from {len(toks)} to its last {len(cut)} tokens", file=sys.stderr)
                prompt_tokens[i] = cut
    if stream is None:
        stream = len(prompts) == 1 and not json and sys.stdout.isatty()
    elif stream and (len(prompts) > 1 or json):
        fail("--stream prints one prompt's text as it comes; it cannot be used with several prompts or --json")
    streamer = TextStream(tokenizer, prompt_tokens[0] if echo else [], sys.stdout) if stream and main_rank else None

    step_times: List[float] = []

    def on_step(pos, next_tokens):
        step_times.append(time.perf_counter())
        if streamer is not None:
            streamer.push(next_tokens[0].item())

    start = time.perf_counter()
    cached = PromptCacheFile(llama, Path(str(prompt_cache))) if prompt_cache is not None else None
    out_tokens, out_logprobs = llama.generate(
        prompt_tokens, max_gen_len, temperature, top_p, logprobs=logprobs, echo=echo,
        kv_cache=not no_kv_cache, on_step=on_step, session=cached.session if cached else None,
        speculate=drafter, draft_tokens=draft_tokens, controls=controls,
        grammar=constraint,
    )
    end = time.perf_counter()
    if cached is not None:
        cached.store(prompt_tokens[0])
    if not main_rank:
        return

    timings = _timings(start, step_times, end)
    if streamer is not None:
        streamer.finish(out_tokens[0])
    for i, toks in enumerate(out_tokens):
        text = tokenizer.decode(toks)
        if json:
            record = {"prompt": prompts[i], "text": text, "tokens": toks, "kv_cache": not no_kv_cache,
                      "timings": timings}
            if logprobs:
                record["logprobs"] = out_logprobs[i]
            if drafter is not None and len(prompts) == 1:
                spec = llama.last_speculation
                record["speculation"] = {"drafted": spec.drafted, "accepted": spec.accepted, "checks": spec.checks,
                                         "plain_steps": spec.plain_steps}
            print(jsonlib.dumps(record, ensure_ascii=False), flush=True)
        elif streamer is None:
            if len(prompts) > 1:
                print(f"==> prompt {i + 1}: {prompts[i]}" if not echo else f"==> prompt {i + 1}")
            print(text, flush=True)
            if len(prompts) > 1 and i < len(prompts) - 1:
                print()
    if stats:
        generated = [len(t) - (len(p) if echo else 0) for t, p in zip(out_tokens, prompt_tokens)]
        started = "n/a" if import_s is None else f"{import_s:.2f} s"
        lines = [
            f"kv cache:        "
            + (f"on ({describe_kv_cache(llama.model.kv_cache_dtype, llama.model.kv_cache_nbytes(1, 1))})"
               if not no_kv_cache else "off"),
            f"device:          {llama.device}",
            f"threads:         {describe_threads(llama.step_threads)}",
            f"run plan:        {llama.info.plan.describe()}",
            f"compiled:        {f'yes ({llama.compiled_step.describe_origin()}), in {llama.info.compile_seconds:.2f} s' if llama.compiled_step else 'no'}",
            f"weights:         {llama.info.quantization or str(llama.model.dtype).removeprefix('torch.')}"
            + (f", on the {llama.info.quant_kernels} kernels" if llama.info.quant_kernels else ""),
            f"prompt tokens:   {sum(len(p) for p in prompt_tokens)} in {len(prompts)} prompt(s)",
            f"generated:       {sum(generated)} tokens",
            f"prefill:         {timings['prefill_s'] * 1000:.1f} ms (to the first new token)",
            f"decode:          {timings['decode_tokens_per_s']:.2f} tokens/s per sequence",
            f"total:           {timings['total_s']:.2f} s",
            f"kv cache bytes:  {llama.last_kv_cache_bytes:,}",
            f"phases:          import {started}, load {load_s:.2f} s, "
            f"prefill {timings['prefill_s']:.2f} s, decode {timings['decode_s']:.2f} s",
        ]
        if drafter is not None:
            lines.insert(3, f"speculation:     {describe_speculation(speculate, draft_model, draft_quantize, draft_tokens)}: "
                            f"{llama.last_speculation.describe()}")
        if cached is not None:
            lines.insert(3, f"prompt cache:    {cached.session.last_reused} tokens reused, "
                            f"{cached.session.last_prefilled} prefilled (loading took {cached.load_s * 1000:.1f} ms)")
        if logprobs and not json:
            lines += [f"logprobs[{i}]:     " + " ".join(f"{lp:.3f}" for lp in lps) for i, lps in enumerate(out_logprobs)]
        print("\n".join(lines), file=sys.stderr)


def batch_sizes(value) -> List[int]:
    """--precompile's batch sizes: 1 for the flag alone, else the number or comma-separated numbers given."""
    return [1] if value is True else whole_numbers(value, "--precompile")


def store_compiled_steps(llama, sizes: List[int]) -> None:
    """Load or build the stored compiled step for each batch size, and say where each is."""
    step = llama.compiled_step
    if step is None or step.ahead_of_time is None:
        if llama.device.type != "cpu":
            fail(f"nothing to precompile on {llama.device}: there the decode step is compiled by torch.compile "
                 "in each process (--compile); stored steps are for the CPU")
        if llama.info.world_size > 1:
            fail("nothing to precompile under torchrun: the stored step runs in one process")
        why = ("the note above says why" if llama.info.notes else "its layers hold tensors a stored step cannot take, "
               "as torch's bf16 kernels' do with --quant-kernels exact")
        fail(f"this model's decode step cannot be compiled ahead of time here ({why}); its runs use the eager step")
    ahead = step.ahead_of_time
    for size in sizes:
        ahead.runner(size)
        how = f"built in {ahead.built[size]:.1f} s" if size in ahead.built else "already stored"
        print(f"compiled decode step for batch size {size}: {how}, in {ahead.directories[size]}", flush=True)


class PromptCacheFile:
    """--prompt-cache: a session loaded from the file when it may be used, and the prompt stored after the run."""

    def __init__(self, llama, path: Path):
        start = time.perf_counter()
        self.llama, self.path = llama, path
        self.session = Session(llama.model)
        self.identity = model_identity(llama)
        self.loaded: List[int] = []
        if path.exists():
            try:
                restore(self.session, load_prompt_cache(path, self.identity, llama.model.n_layers,
                                                        llama.model.kv_cache_dtype))
                self.loaded = list(self.session.tokens)
            except PromptCacheError as e:
                if is_main_rank(llama):
                    print(f"note: ignoring the prompt cache: {as_flags(str(e))}; it will be replaced", file=sys.stderr)
        self.load_s = time.perf_counter() - start

    def store(self, prompt: List[int]) -> None:
        """Save the prompt's keys and values, unless the file holds exactly them already."""
        self.session.keep(len(prompt))  # the generated tokens are not part of the prompt
        if self.session.tokens != self.loaded and len(self.session.tokens) == len(prompt):
            save_prompt_cache(self.path, self.session, self.identity, describe_model(self.llama))


def _timings(start: float, step_times: List[float], end: float) -> dict:
    """Prefill is the time to the first new token; decode covers the steps after it."""
    prefill = (step_times[0] - start) if step_times else end - start
    decode_steps = len(step_times) - 1
    decode_s = (step_times[-1] - step_times[0]) if decode_steps > 0 else 0.0
    return {
        "prefill_s": round(prefill, 6),
        "decode_s": round(decode_s, 6),
        "decode_steps": max(decode_steps, 0),
        "decode_tokens_per_s": round(decode_steps / decode_s, 3) if decode_s > 0 else 0.0,
        "total_s": round(end - start, 6),
    }


def cli() -> None:
    run(main, "llama-generate", raw_string_flags=("--prompt",) + STRUCTURED_RAW_FLAGS)


if __name__ == "__main__":
    cli()
