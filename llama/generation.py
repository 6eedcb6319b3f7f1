"""Text generation with Meta's API and a KV-cache switch.

With the cache, the prompt is fed once (in chunks of PROMPT_CHUNK positions) and then one token per step at its
position. Without it, every step feeds the whole prefix `tokens[:, :cur_pos]` from position 0. Both compute the
same logits; the cache only saves the work of recomputing keys and values of positions already seen.
"""

import gc
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Set, Tuple, TypedDict, Union

import torch

from llama.compile.step import Step
from llama.constraint import Constraint, Grammar
from llama.dialog import UNSAFE_ERROR, Dialog, Message, encode_dialog, has_special_tags
from llama.errors import LlamaError
from llama.kv_cache import KVCache
from llama.load import LoadInfo, load
from llama.model import Transformer
from llama.nn.session import Session
from llama.run_plan import ModelFlags
from llama.runtime.devices import check_fits
from llama.runtime.progress import Progress
from llama.runtime.threads import StepThreads
from llama.sampling import (  # noqa: F401 (Meta's names, here too)
    SamplingControls, apply_controls, check_controls, check_finite, check_sampling, logprobs_of, sample, sample_top_p,
)
from llama.speculative import (DEFAULT_DRAFT_TOKENS, Drafter, Speculation, SpeculationStats, check_speculation,
                               new_drafter)
from llama.tokenizer import Tokenizer


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


class ChatPrediction(TypedDict, total=False):
    generation: Message
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


# Called after each generation step with the position just filled and its (bsz,) tokens.
StepCallback = Callable[[int, torch.Tensor], None]

# With the cache, a prompt is fed in chunks that end at multiples of this many positions. A chunk attends over the
# positions up to its own, where the whole prompt at once would attend over all of them under a mask: faster on long
# prompts (docs/benchmarks.md), and its logits stay those of the positions alone.
PROMPT_CHUNK = 512


def feed_in_chunks(forward: Callable[..., torch.Tensor], tokens: torch.Tensor, prev_pos: int, cur_pos: int,
                   cache: List[KVCache], num_logits: int) -> torch.Tensor:
    """`forward(tokens[:, prev_pos:cur_pos], prev_pos, cache, num_logits=num_logits)`, the tokens fed in chunks that
    end at multiples of PROMPT_CHUNK: the logits of the last num_logits positions, (bsz, num_logits, vocab)."""
    ends = list(range(prev_pos - prev_pos % PROMPT_CHUNK + PROMPT_CHUNK, cur_pos, PROMPT_CHUNK)) + [cur_pos]
    parts, start = [], prev_pos
    for end in ends:
        wanted = end - max(start, cur_pos - num_logits)  # how many of this chunk's positions want logits
        logits = forward(tokens[:, start:end], start, cache, num_logits=max(wanted, 1))
        if wanted > 0:
            parts.append(logits)
        start = end
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


@contextmanager
def _decoding(threads: Optional[StepThreads]) -> Iterator[None]:
    """Around a decode loop: Python's cyclic garbage collector off, and back as it was after (each step's few
    objects set off collections that walk every object torch and the model hold, a cost paid every token where the
    caller has not frozen them as the commands do with gc.freeze(); whatever a loop leaves in cycles is collected
    after it, as usual); and torch's thread count as it was, where `threads` moved it (a no-op where no step was
    timed, as without the cache)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if threads is not None:
            threads.close()
        if enabled:
            gc.enable()


def _trim(prompt_tokens: List[List[int]], tokens: torch.Tensor, token_logprobs: Optional[torch.Tensor], filled: int,
          max_gen_len: int, echo: bool, stop_set: Set[int]) -> Tuple[List[List[int]], Optional[List[List[float]]]]:
    """Each row's returned tokens (and logprobs): up to its first generated stop token, with or without its prompt."""
    out_tokens, out_logprobs = [], []
    for i, t in enumerate(prompt_tokens):
        # Every row is past its prompt by the time `filled` stops short of total_len.
        toks = tokens[i, : min(len(t) + max_gen_len, filled)].tolist()
        # Cut at the first stop token among the generated ones (a chat prompt may hold eos of its own).
        for j in range(len(t), len(toks)):
            if toks[j] in stop_set:
                toks = toks[:j]
                break
        start = 0 if echo else len(t)
        out_tokens.append(toks[start:])
        if token_logprobs is not None:
            out_logprobs.append(token_logprobs[i, start : len(toks)].tolist())
    return out_tokens, (out_logprobs if token_logprobs is not None else None)


class Llama:
    """A model and its tokenizer, ready to generate."""

    @staticmethod
    def build(
        ckpt_dir: Union[str, Path],
        tokenizer_path: Optional[Union[str, Path]] = None,
        max_seq_len: int = 2048,
        max_batch_size: int = 8,
        model_parallel_size: Optional[int] = None,
        seed: int = 1,
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[Union[str, torch.dtype]] = None,
        compile: Optional[Union[bool, str]] = None,
        quantize: Optional[str] = None,
        progress: Optional[Progress] = None,
        quant_kernels: str = "integer",
        compile_batch_size: int = 1,
        compile_layers: Optional[Union[bool, str]] = None,
        kv_cache_dtype: Optional[str] = None,
    ) -> "Llama":
        """Load a checkpoint in Meta's layout.

        The arguments but `progress` are a `ModelFlags` (llama/run_plan.py; `Llama.from_flags` takes one): every path
        the run takes is decided from them and the machine once (`plan_run`), and `info.plan` says what was decided.

        Args:
            ckpt_dir: directory with params.json and consolidated.NN.pth, or a .gguf file or Hugging Face
                LLaMA folder, converted on first use into $LLAMA_HOME/converted (llama/convert/cache.py).
            tokenizer_path: the tokenizer file; None looks inside ckpt_dir (and one level up, where Meta's
                downloads put it).
            max_seq_len: the longest prompt plus generation a run may use.
            max_batch_size: the most prompts one call may take.
            model_parallel_size: ranks to split the model across; None takes the number of processes
                torchrun started (1 without torchrun). As with Meta's build, ranks other than 0 then print
                nothing to stdout (LLAMA_PRINT_ALL_RANKS=1 keeps it; see llama/runtime/distributed.py).
            seed: seed of the sampling generator.
            device: "cpu", "cuda", "cuda:N"; None picks CUDA when present, else CPU.
            dtype: "float32", "bfloat16" or "float16"; None picks bf16 on CUDA (fp16 where bf16 is
                unsupported) and float32 on CPU.
            compile: run the generation steps after the prompt compiled (llama/compile/step.py). True: on the CPU
                the one-token step with the cache comes from a package stored under $LLAMA_HOME (built the
                first time for a model shape and batch size, in under a minute for small models, then loaded
                in milliseconds; llama/compile/aot.py), and every other step (the uncached one, any step on a GPU) is
                compiled by torch.compile at its first use (minutes). "auto": the stored step where it can be
                had (the CPU, one process, a C++ compiler), everything else eager, with a note when the
                compiler is missing; a package not stored yet is built on a background thread while the eager
                step runs (the same tokens; on the integer kernels the same bits), used from the first step
                after it is ready, and waited for when the process exits so that later runs load it
                (`compiled_step.wait()` waits now). False: every step eager, the plain reference. None (the default) is what
                the commands do with no flag: "auto", unless $LLAMA_COMPILE is 0 (False) or 1 (True). A
                first build is silent unless `progress` is given. Needs a C++ compiler on the CPU; one process only.
            quantize: None, "int8" (per output channel) or "int4" (groups of 32 columns): quantize every
                linear layer as it loads (llama/quant/quantize.py). A checkpoint stored quantized (it has
                quantization.json) loads as stored without it; asking it for another method is an error.
            progress: told ("loading weights", done, total) as the tensors load, and around a first build of
                the integer kernels (llama/runtime/progress.py).
            compile_batch_size: the batch size whose compiled step is ready when this returns (loaded, or built
                and stored); steps at other batch sizes are made at their first use.
            compile_layers: with compile=False, plan the layers (llama/quant/layer_plan.py) for a decode step the
                caller compiles itself with this mode (llama-server's); None: for the step `compile` makes.
            quant_kernels: what quantized layers multiply with on the CPU. "integer" (the default): the
                integer kernels of llama/kernels, which round each row of activations to int8 blocks of 32
                as llama.cpp does (fast; cached and uncached runs agree within the bound
                tests/kernels/test_int_kernels.py states, not to float32 rounding); where they cannot run (no C++
                compiler, not x86) the exact paths run and `info.notes` says why. "exact": the weight-only
                paths, which multiply the activations as they are by the dequantized weights.
            kv_cache_dtype: what the KV cache holds keys and values in: "auto" or None (the model's dtype),
                "float32", "bfloat16", or "int8" (blocks of 32 along head_dim with a float32 scale each;
                llama/kv_cache.py). The uncached pass rounds its keys and values alike (the same bits on the
                integer kernels). On the CPU the stored compiled step takes such a cache too (a package per cache
                dtype); elsewhere another dtype than the model's runs the decode step eagerly (compile=True is refused).

        A checkpoint stored in bfloat16 whose float32 copy would not fit in memory runs in bfloat16 on the
        CPU when no dtype is given; `info.notes` then says so. It also says when quantized layers will run
        slowly (eagerly in float32 on the CPU, on the exact paths) and what would run them fast.

        Raises:
            LlamaError: a file is missing or malformed, or the weights do not match params.json.
        """
        flags = ModelFlags(None if ckpt_dir is None else str(ckpt_dir),
                           None if tokenizer_path is None else str(tokenizer_path), max_seq_len, max_batch_size,
                           model_parallel_size, seed, device, dtype, compile, quantize, quant_kernels, kv_cache_dtype,
                           compile_batch_size, compile_layers)
        return Llama.from_flags(flags, progress)

    @staticmethod
    def from_flags(flags: ModelFlags, progress: Optional[Progress] = None) -> "Llama":
        """`Llama.build` with its arguments as one `ModelFlags` (llama/run_plan.py), as the commands hold them."""
        loaded = load(flags, progress)
        llama = Llama(loaded.model, loaded.tokenizer, seed=flags.seed, info=loaded.info)
        llama.compiled_step = loaded.step
        if loaded.info.plan is not None and loaded.info.plan.adapt_threads:
            threads = StepThreads()
            llama.step_threads = threads if threads.works else None
        return llama

    def __init__(self, model: Transformer, tokenizer: Tokenizer, seed: int = 1, info: Optional[LoadInfo] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.device = model.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.info = info if info is not None else LoadInfo()
        self.compiled_step: Optional[Step] = None  # set by build(compile=True): runs the steps after the prompt
        # Moves the threads of the steps after the prompt with the cores they get (llama/runtime/threads.py); set by
        # build where the plan says no result depends on the thread count.
        self.step_threads: Optional[StepThreads] = None
        self.last_kv_cache_bytes = 0
        self.last_speculation = SpeculationStats()  # what the last generate() call's speculation did

    @torch.inference_mode()
    def generate(
        self,
        prompt_tokens: List[List[int]],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        logprobs: bool = False,
        echo: bool = False,
        kv_cache: bool = True,
        on_step: Optional[StepCallback] = None,
        ignore_stop: bool = False,
        session: Optional[Session] = None,
        speculate: Union[str, Drafter, None] = None,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        controls: Optional[SamplingControls] = None,
        grammar: Optional[Grammar] = None,
    ) -> Tuple[List[List[int]], Optional[List[List[float]]]]:
        """Continue each prompt until it emits a stop token or reaches max_gen_len new tokens (or max_seq_len).

        Args:
            prompt_tokens: one list of token ids per prompt; lengths may differ.
            max_gen_len: the most tokens to add to each prompt.
            temperature: softmax temperature; 0 picks the most likely token (greedy).
            top_p: nucleus-sampling threshold.
            logprobs: also return the log-probability of every returned token.
            echo: return the prompt's tokens before the generated ones. Their log-probabilities are those
                of each prompt token given the ones before it; the first, having none before it, gets 0.
            kv_cache: True feeds only the newest token each step, keeping past keys and values in a
                cache; False feeds the whole prefix every step. The results are the same.
            on_step: called after every step with the position filled and the (bsz,) tokens put there.
            ignore_stop: run every row to max_gen_len new tokens (or max_seq_len), stop tokens included,
                as benchmarks that need exact lengths do (not under a grammar, which allows nothing after a stop).
            session: a KV cache kept between calls (llama/nn/session.py), for one prompt: only the prompt's
                tokens after the longest prefix it already holds are fed. The results are the same.
            speculate: "ngram" drafts tokens by prompt lookup and checks them in one step each
                (llama/speculative.py): at temperature 0 the same tokens, faster where the output repeats the
                prompt; above it the same distribution. An object with a `draft(tokens, k)` method drafts
                instead. Needs the cache; several prompts run one after another, and `on_step` is then told
                each one's (1,) tokens. None: the plain decode.
            draft_tokens: the most tokens a draft holds.
            controls: penalties, biases, top-k and min-p applied to each row's logits before temperature and
                top_p (llama/sampling.py's `apply_controls`), from the row's own tokens; not with `speculate`.
            grammar: what every row's generated text must be (llama/constraint.py's `Grammar`: a JSON schema, any
                JSON object, or a Lark or GBNF grammar): tokens it forbids are masked before the controls, and a
                row whose grammar is complete can only stop. Needs llguidance (the `structured` extra); not with
                `speculate`.

        Returns:
            (tokens, logprobs): per prompt, the returned token ids, ending before the stop token; and
            their log-probabilities, or None unless asked for.
        """
        self._check_request(prompt_tokens, max_gen_len, temperature, top_p, kv_cache, session)
        check_speculation(speculate, draft_tokens, kv_cache)
        if controls is not None and controls.active:
            check_controls(controls, self.model.params.vocab_size)
            if speculate is not None:
                raise LlamaError("sampling controls (penalties, logit_bias, top_k, min_p) cannot be used with "
                                 "speculation; leave out one or the other")
        else:
            controls = None
        if grammar is not None and speculate is not None:
            raise LlamaError("a grammar or JSON schema cannot be used with speculation; leave out one or the other")
        constraints = [Constraint(grammar, self.tokenizer) for _ in prompt_tokens] if grammar is not None else None
        if speculate is not None and len(prompt_tokens) > 1:  # each alone: rows keep no common pace when speculating
            runs, stats = [], SpeculationStats()
            for t in prompt_tokens:
                runs.append(self.generate([t], max_gen_len, temperature, top_p, logprobs, echo, kv_cache, on_step,
                                          ignore_stop, session, speculate, draft_tokens))
                stats.add(self.last_speculation)
            self.last_speculation = stats
            return [r[0][0] for r in runs], ([r[1][0] for r in runs] if logprobs else None)
        self.last_speculation = SpeculationStats()
        bsz = len(prompt_tokens)
        min_prompt_len = min(len(t) for t in prompt_tokens)
        total_len = min(self.model.params.max_seq_len, max_gen_len + max(len(t) for t in prompt_tokens))
        self._check_memory(bsz, total_len, logprobs, kv_cache and session is None)
        tokens, prompt_mask = self._token_buffers(prompt_tokens, total_len)
        token_logprobs = torch.zeros((bsz, total_len), dtype=torch.float, device=self.device) if logprobs else None
        stop_list = [] if ignore_stop and grammar is None else self.tokenizer.stop_ids
        stop_ids = torch.tensor(stop_list, dtype=torch.long, device=self.device)
        stopped = torch.zeros(bsz, dtype=torch.bool, device=self.device)

        prev_pos = 0
        if session is not None:
            # Echoed logprobs need the logits of every prompt position, so nothing can be skipped then.
            cache, prev_pos = session.begin(prompt_tokens[0], reuse=not (logprobs and echo))
        else:
            # Sized for this run, not for max_batch_size x max_seq_len: the last token is sampled, never fed.
            cache = self.model.new_kv_cache(bsz, total_len) if kv_cache else None
        self.last_kv_cache_bytes = sum(c.nbytes for c in cache) if cache else 0

        if min_prompt_len == total_len and logprobs:  # nothing to generate: score the prompts alone
            token_logprobs[:, 1:] = logprobs_of(self.model(tokens, 0)[:, :-1], tokens[:, 1:])

        filled = min_prompt_len
        if speculate is not None:
            speculation = Speculation(draft_tokens, new_drafter(speculate))
            if min_prompt_len < total_len:
                with _decoding(self.step_threads):
                    filled, prev_pos = speculation.decode(
                        tokens, min_prompt_len, prev_pos, total_len,
                        lambda start, end, n, first: self._forward(tokens, start, end, cache, True, n, first),
                        lambda n: self.compiled_step is None or self.compiled_step.verifies(n, cache),
                        temperature, top_p, self.generator, set(stop_list), token_logprobs, on_step)
            self.last_speculation = speculation.stats
        else:
            with _decoding(self.step_threads):
                for cur_pos in range(min_prompt_len, total_len):
                    # Logits for positions prev_pos .. cur_pos - 1, either way; only the last unless logprobs are wanted.
                    logits = self._forward(tokens, prev_pos, cur_pos, cache, kv_cache, num_logits=cur_pos - prev_pos if logprobs else 1,
                                           first=cur_pos == min_prompt_len)
                    last = logits[:, -1]
                    if constraints is not None:
                        # Rows still reading their prompt, or stopped, are not sampled from: they keep their logits.
                        last = torch.stack([
                            constraints[k].mask(last[k], tokens[k, len(t) : cur_pos].tolist())
                            if cur_pos >= len(t) and not stopped[k] else last[k]
                            for k, t in enumerate(prompt_tokens)])
                    if controls is not None:
                        last = torch.stack([apply_controls(last[k], controls, tokens[k, :cur_pos].tolist(), len(t))
                                            for k, t in enumerate(prompt_tokens)])
                    next_token = sample(last, temperature, top_p, self.generator)
                    # Rows whose prompt is longer than the shortest one are still reading their prompt.
                    next_token = torch.where(prompt_mask[:, cur_pos], tokens[:, cur_pos], next_token)
                    tokens[:, cur_pos] = next_token
                    if logprobs:
                        token_logprobs[:, prev_pos + 1 : cur_pos + 1] = logprobs_of(logits, tokens[:, prev_pos + 1 : cur_pos + 1])
                    stopped |= ~prompt_mask[:, cur_pos] & torch.isin(next_token, stop_ids)
                    prev_pos, filled = cur_pos, cur_pos + 1
                    if on_step is not None:
                        on_step(cur_pos, next_token)
                    if bool(stopped.all()):
                        break
        if session is not None:
            session.end(tokens[0, :prev_pos].tolist())  # the last token was sampled, never fed
        return _trim(prompt_tokens, tokens, token_logprobs, filled, max_gen_len, echo, set(stop_list))

    def _check_request(self, prompt_tokens: List[List[int]], max_gen_len: int, temperature: float, top_p: float,
                       kv_cache: bool, session: Optional[Session]) -> None:
        """Raise LlamaError for anything `generate` cannot run, before any work."""
        params = self.model.params
        bsz = len(prompt_tokens)
        if bsz == 0:
            raise LlamaError("no prompts to generate from")
        if bsz > params.max_batch_size:
            raise LlamaError(f"{bsz} prompts exceed max_batch_size {params.max_batch_size}")
        check_sampling(temperature, top_p, max_gen_len)
        for i, t in enumerate(prompt_tokens):
            if len(t) == 0:
                raise LlamaError(f"prompt {i} has no tokens")
            if len(t) > params.max_seq_len:
                raise LlamaError(f"prompt {i} is {len(t)} tokens long, more than max_seq_len {params.max_seq_len}")
            if min(t) < 0 or max(t) >= params.vocab_size:
                raise LlamaError(f"prompt {i} holds token ids outside the vocabulary of {params.vocab_size}")
        if session is not None and (bsz != 1 or not kv_cache):
            raise LlamaError("a session keeps the KV cache of one sequence: give it one prompt, with the cache on")

    def _check_memory(self, bsz: int, total_len: int, logprobs: bool, new_cache: bool) -> None:
        """Refuse before allocating what cannot fit: the token, mask and logprob buffers, and the cache."""
        n_bytes = bsz * total_len * (8 + 1 + (4 if logprobs else 0))
        n_bytes += self.model.kv_cache_nbytes(bsz, total_len) if new_cache else 0
        check_fits(n_bytes, self.device, f"generating {bsz} x {total_len} positions{' with a KV cache' if new_cache else ''}")

    def _token_buffers(self, prompt_tokens: List[List[int]], total_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(tokens, prompt_mask), both (bsz, total_len): the prompts left-aligned, and where they are."""
        tokens = torch.zeros((len(prompt_tokens), total_len), dtype=torch.long, device=self.device)
        prompt_mask = torch.zeros((len(prompt_tokens), total_len), dtype=torch.bool, device=self.device)
        for k, t in enumerate(prompt_tokens):
            tokens[k, : len(t)] = torch.tensor(t, dtype=torch.long, device=self.device)
            prompt_mask[k, : len(t)] = True
        return tokens, prompt_mask

    def _forward(self, tokens: torch.Tensor, prev_pos: int, cur_pos: int, cache: Optional[List[KVCache]],
                 kv_cache: bool, num_logits: int, first: bool) -> torch.Tensor:
        """One step's logits: with the cache, the tokens since prev_pos at their positions; without it, the
        whole prefix from position 0. Raises LlamaError for NaN or infinite logits."""
        # The prompt runs eagerly, so that a new prompt length never costs a compilation; so does a step at
        # position 1 (after a one-token prompt), which the compiled step would specialise on and compile anew.
        eager = first or (kv_cache and prev_pos < 2)
        forward = self.compiled_step if self.compiled_step is not None and not eager else self.model
        timed = self.step_threads if kv_cache and not first and self.step_threads is not None else nullcontext()
        with timed:
            if kv_cache and forward is self.model:
                logits = feed_in_chunks(forward, tokens, prev_pos, cur_pos, cache, num_logits)
            elif kv_cache:  # the compiled step: one token, or a draft to verify, in the shape it was built for
                logits = forward(tokens[:, prev_pos:cur_pos], prev_pos, cache, num_logits=num_logits)
            else:
                logits = forward(tokens[:, :cur_pos], 0, None, num_logits=num_logits)
        check_finite(logits[:, -1], cur_pos - 1)
        return logits

    def text_completion(
        self,
        prompts: List[str],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        echo: bool = False,
        kv_cache: bool = True,
        speculate: Union[str, Drafter, None] = None,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        grammar: Optional[Grammar] = None,
    ) -> List[CompletionPrediction]:
        """Continue each text prompt; see `generate` for the arguments.

        `max_gen_len` None allows up to max_seq_len - 1 new tokens.
        """
        if max_gen_len is None:
            max_gen_len = self.model.params.max_seq_len - 1
        prompt_tokens = [self.tokenizer.encode(x, bos=True, eos=False) for x in prompts]
        generation_tokens, generation_logprobs = self.generate(
            prompt_tokens, max_gen_len, temperature, top_p, logprobs, echo, kv_cache, speculate=speculate,
            draft_tokens=draft_tokens, grammar=grammar,
        )
        if logprobs:
            return [
                {"generation": self.tokenizer.decode(t), "tokens": [self.tokenizer.decode([x]) for x in t],
                 "logprobs": lp}
                for t, lp in zip(generation_tokens, generation_logprobs)
            ]
        return [{"generation": self.tokenizer.decode(t)} for t in generation_tokens]

    def dialog_tokens(self, dialog: Dialog) -> List[int]:
        """The prompt tokens of a dialog in the model's chat format, ending where the assistant's reply begins."""
        return encode_dialog(self.tokenizer, dialog)

    def chat_completion(
        self,
        dialogs: List[Dialog],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        kv_cache: bool = True,
        speculate: Union[str, Drafter, None] = None,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        grammar: Optional[Grammar] = None,
    ) -> List[ChatPrediction]:
        """The assistant's next message for each dialog, in the tokenizer's chat format (LLaMA-2's or ChatML).

        A dialog whose messages contain the format's own tags ([INST], <<SYS>>, ...) is not run; its
        reply is an error message, as in Meta's reference.
        """
        if max_gen_len is None:
            max_gen_len = self.model.params.max_seq_len - 1
        prompt_tokens = [self.dialog_tokens(d) for d in dialogs]  # checks each dialog's shape first
        unsafe = [has_special_tags(d, self.tokenizer.chat_format) for d in dialogs]
        generation_tokens, generation_logprobs = self.generate(
            prompt_tokens, max_gen_len, temperature, top_p, logprobs, echo=False, kv_cache=kv_cache,
            speculate=speculate, draft_tokens=draft_tokens, grammar=grammar,
        )
        predictions: List[ChatPrediction] = []
        for i, t in enumerate(generation_tokens):
            content = UNSAFE_ERROR if unsafe[i] else self.tokenizer.decode(t)
            pred: ChatPrediction = {"generation": {"role": "assistant", "content": content}}
            if logprobs:
                pred["tokens"] = [self.tokenizer.decode([x]) for x in t]
                pred["logprobs"] = generation_logprobs[i]
            predictions.append(pred)
        return predictions
