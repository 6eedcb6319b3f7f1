"""The serving loop: requests in, one batched step after another, text and log-probabilities out.

It joins the three rooms without letting them reach into each other. The HTTP layer hands in a `Job` (token
ids and sampling settings, no HTTP) and is told what happens through the job's `emit` callback, from the
loop's thread. The scheduler decides each step over `SequenceState`s; the runner feeds `Row`s. Here a job
becomes its sequences (one per choice), a scheduled piece becomes a row, a sampled token becomes text
(llama/detokenize.py) and a finish reason.

With speculation (`speculate="ngram"`), before each step every decoding sequence may get a draft by prompt lookup
(llama/speculative.py), which the step checks; the tokens kept are taken one by one as sampled ones are, so stop
tokens, stop strings and max_tokens end a choice where they would without it. A choice under a grammar (a
`response_format` schema, llama/constraint.py) has a matcher of its own that its sampler masks the logits with, and
takes plain steps.
"""

import random
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import torch

from llama.constraint import Constraint, Grammar
from llama.detokenize import TextState
from llama.server.disk_cache import DiskCache
from llama.sampling import SamplingControls
from llama.server.runner import Result, Row, Runner, Sampler
from llama.server.scheduler import WAITING, Scheduler, SequenceState
from llama.speculative import DEFAULT_DRAFT_TOKENS, Drafter, Speculation, new_drafter


# The most rows a step feeds with speculation's drafts among them: a step of a few rows costs little more than one
# of 1, so one client's drafts pay, but at 8 clients they made the step slower than they paid (docs/speculative.md
# has the figures, scripts/bench_server_speculative.py measures them). So a full batch of 8 takes plain steps.
MAX_STEP_ROWS = 8


class Unavailable(Exception):
    """The engine takes no more work now: its queue is full, or it is shutting down."""


@dataclass
class TokenLogprob:
    token: int
    logprob: Optional[float]  # None: the first prompt token, which nothing predicts
    top: List[Tuple[int, float]] = field(default_factory=list)


@dataclass
class Delta:
    """New text of one choice, the log-probabilities of the tokens behind it, and its end when it has one."""

    index: int
    text: str = ""
    logprobs: List[TokenLogprob] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" or "length" (max_tokens, or cut by the shutdown) on a choice's last delta


@dataclass
class PromptLogprobs:
    """The log-probability of every prompt token given the ones before it (for completions' echo)."""

    index: int
    logprobs: List[TokenLogprob]


@dataclass
class Done:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    disk_tokens: Optional[int] = None  # of the cached tokens, those loaded from disk (None: no disk cache)
    drafted_tokens: Optional[int] = None  # speculation's tokens drafted and checked, over every choice (None: off)
    accepted_tokens: Optional[int] = None  # and of them, kept


@dataclass
class Failed:
    message: str
    status: int = 500


Event = object  # Delta | PromptLogprobs | Done | Failed


@dataclass(eq=False)
class Job:
    """One prompt and how to continue it `n` times; what happens is told to `emit`, from the engine's thread.

    `seed` makes sampling reproducible whatever else runs: choice i draws from its own generator, seeded
    with seed + i. `logprobs` None reports none; k reports each token's and the k likeliest alternatives'.
    `cache_prompt` False computes the whole prompt even where the cache holds a prefix of it (same answer).
    `controls` change each choice's logits before sampling (llama/sampling.py), from the choice's own tokens.
    `grammar` constrains each choice's tokens (llama/constraint.py): its own matcher masks its logits before the
    controls; such a choice gets no drafts, and a stop token ends it even with `ignore_eos` (the grammar allows
    nothing after it).
    """

    prompt: List[int]
    max_tokens: int
    emit: Callable[[Event], None]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    logprobs: Optional[int] = None
    echo_logprobs: bool = False
    ignore_eos: bool = False  # stop tokens do not end it: it runs to max_tokens (benchmarks)
    text_context: bool = False  # decode completions after the prompt's last tokens (keeps a leading space)
    cache_prompt: bool = True
    controls: Optional[SamplingControls] = None
    grammar: Optional[Grammar] = None
    sequences: List[SequenceState] = field(default_factory=list)
    remaining: int = 0
    drafted: int = 0  # speculation's tokens drafted and checked, over its choices
    accepted: int = 0


@dataclass(eq=False)
class _Choice:
    job: Job
    index: int
    text: TextState
    sampler: Sampler
    speculation: Optional[Speculation] = None
    pending: List[TokenLogprob] = field(default_factory=list)


class Engine:
    """Runs the scheduler and the runner in a thread of its own, one step after another.

    Args:
        tokenizer: the model's tokenizer (for the stop tokens and the text).
        scheduler: decides each step.
        runner: runs it.
        max_waiting: jobs that may wait for room before `submit` refuses more.
        log: told a line (with its traceback) when something fails inside the loop; the server goes on.
        disk: where every full block that enters the prefix tree is also kept (llama/server/disk_cache.py), the
            one the scheduler loads blocks from; closed when the engine has drained.
        speculate: "ngram" drafts tokens by prompt lookup for every choice and checks them in the batched step (or
            a drafter, llama/speculative.py's `Drafter`, shared by every choice); None decodes one token a step.
        draft_tokens: the most tokens a draft holds.
    """

    def __init__(self, tokenizer, scheduler: Scheduler, runner: Runner, max_waiting: int = 64,
                 log: Callable[[str], None] = lambda line: None, disk: Optional[DiskCache] = None,
                 speculate: Union[str, Drafter, None] = None, draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        self.tokenizer, self.scheduler, self.runner, self.log = tokenizer, scheduler, runner, log
        self.disk = disk
        self.speculate, self.draft_tokens = speculate, draft_tokens
        self.stop_ids = set(tokenizer.stop_ids)
        self.max_waiting = max_waiting
        self._inbox: Deque[Tuple[str, Job]] = deque()
        self._wake = threading.Condition()
        self._choices: Dict[SequenceState, _Choice] = {}
        self._accepting = True
        self._deadline: Optional[float] = None  # when draining: jobs still running then are cut short
        self._refused_waiting = False  # when draining: jobs that never ran have been sent away
        self._thread: Optional[threading.Thread] = None
        # Counters for /metrics.
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0
        self.steps_total = 0
        self.drafted_tokens_total = 0
        self.accepted_tokens_total = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="llama-server-engine", daemon=True)
        self._thread.start()

    def check(self, prompt_len: int, max_tokens: int) -> Optional[str]:
        """Why a prompt of `prompt_len` tokens continued by up to `max_tokens` could never run, or None."""
        return self.scheduler.check_fits(prompt_len, max_tokens)

    def most_new_tokens(self, prompt_len: int) -> Optional[int]:
        """The most tokens a prompt of `prompt_len` tokens could be continued by, None without a limit."""
        return self.scheduler.most_new_tokens(prompt_len)

    def submit(self, job: Job) -> None:
        """Queue a job (from any thread).

        Raises:
            Unavailable: the queue is full or the engine is shutting down.
            ValueError: the job could never fit the KV cache (`check` says why).
        """
        reason = self.check(len(job.prompt), job.max_tokens)
        if reason is not None:
            raise ValueError(reason)
        with self._wake:
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            if self.waiting_jobs() >= self.max_waiting:
                raise Unavailable(f"the server is busy: its queue of {self.max_waiting} waiting requests is full; "
                                  "try again later")
            self._inbox.append(("submit", job))
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job (its client left): its sequences leave the batch at the next step."""
        with self._wake:
            self._inbox.append(("cancel", job))
            self._wake.notify()

    def waiting_jobs(self) -> int:
        """Jobs queued and not yet running (callable from any thread)."""
        choices = [self._choices.get(s) for s in list(self.scheduler.waiting)]
        waiting = {id(c.job) for c in choices if c is not None}
        return len(waiting) + sum(1 for kind, _ in list(self._inbox) if kind == "submit")

    def stop_accepting(self, grace: float) -> None:
        """Take no new jobs, fail those that have not started (503), and after `grace` seconds end those still
        running as if they had reached max_tokens (finish reason "length"). From any thread; returns at once."""
        with self._wake:
            self._accepting = False
            deadline = time.monotonic() + grace
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._wake.notify()

    def drain(self, grace: float) -> None:
        """`stop_accepting`, then return when the loop has stopped and the blocks for the disk are written."""
        self.stop_accepting(grace)
        if self._thread is not None:
            self._thread.join()
        if self.disk is not None:
            self.disk.close()

    # The loop, in the engine's thread.

    def _loop(self) -> None:
        while True:
            try:
                if self._iterate():
                    return
            except Exception as e:  # a bug here must not stop the server: the jobs in flight end, the loop goes on
                self._report("the serving loop failed", e)
                for job in self._jobs():
                    try:
                        self._fail(job, Failed(f"the server failed on this request: {type(e).__name__}"))
                    except Exception as again:
                        self._report("ending a request failed too", again)
                        job.emit(Failed(f"the server failed on this request: {type(e).__name__}"))

    def _iterate(self) -> bool:
        """One turn of the loop: take what came in, run a step; True when the loop should end."""
        with self._wake:
            while not self._inbox and not self.scheduler.has_work and self._accepting:
                self._wake.wait()
            inbox, self._inbox = list(self._inbox), deque()
        for kind, job in inbox:
            if kind == "cancel":
                self._cancel(job)
                continue
            try:
                self._add(job)
            except Exception as e:
                self._report("a request could not be queued", e)
                self._fail(job, Failed(f"the server could not queue this request: {type(e).__name__}: {e}"))
        if not self._accepting and not self._refused_waiting:
            self._refuse_waiting()
        if self._deadline is not None and time.monotonic() > self._deadline:
            for job in self._jobs():
                self._cut(job)
        if not self._accepting and not self.scheduler.has_work and not self._inbox:
            return True
        if self.scheduler.has_work:
            self._step()
        return False

    def _jobs(self) -> List[Job]:
        """The jobs with a choice still unfinished, each once."""
        return list({id(c.job): c.job for c in self._choices.values()}.values())

    def _refuse_waiting(self) -> None:
        """Shutting down: a job none of whose choices ever ran gets 503 at once, so its client can go elsewhere."""
        self._refused_waiting = True
        for job in self._jobs():
            if all(seq.status == WAITING and seq.preemptions == 0 for seq in job.sequences):
                self._fail(job, Failed("the server is shutting down; this request had not started", 503))

    def _cut(self, job: Job) -> None:
        """The shutdown's grace is over: every unfinished choice ends here, as a max_tokens cut ends it ("length")."""
        for seq in list(job.sequences):
            choice = self._choices.get(seq)
            if choice is not None:
                self._end(seq, choice, choice.text.finish(), "length")

    def _report(self, what: str, e: Exception) -> None:
        self.log(f"llama-server: {what}: {type(e).__name__}: {e}\n" + "".join(traceback.format_exception(e)).rstrip())

    def _add(self, job: Job) -> None:
        if not self._accepting:
            job.emit(Failed("the server is shutting down", 503))
            return
        first = None
        controls = job.controls if job.controls is not None and job.controls.active else None
        for i in range(job.n):
            seq = SequenceState(job.prompt, prompt_logprobs=job.echo_logprobs and i == 0,
                                reuse_prefix=job.cache_prompt, after=first)
            first = first or seq
            seed = (job.seed + i) % 2**64 if job.seed is not None else random.getrandbits(63)
            generator = torch.Generator(device=self.runner.device).manual_seed(seed)
            context = job.prompt if job.text_context else ()
            constraint = Constraint(job.grammar, self.tokenizer) if job.grammar is not None else None
            speculation = (Speculation(self.draft_tokens, new_drafter(self.speculate))
                           if self.speculate and constraint is None else None)
            self._choices[seq] = _Choice(job, i, TextState(self.tokenizer, job.stop, context),
                                         Sampler(job.temperature, job.top_p, generator, job.logprobs, controls,
                                                 len(job.prompt), constraint), speculation)
            job.sequences.append(seq)
            self.scheduler.add(seq)
        job.remaining = job.n
        self.prompt_tokens_total += len(job.prompt)

    def _cancel(self, job: Job) -> None:
        for seq in job.sequences:
            if seq in self._choices:
                self.scheduler.abort(seq)
                del self._choices[seq]

    def _fail(self, job: Job, failure: Failed) -> None:
        self._cancel(job)
        job.emit(failure)

    def _step(self) -> None:
        if self.speculate:
            self._draft()
        step = self.scheduler.schedule()
        self.preemptions_total += len(step.preempted)
        if not step:  # everything left waits on something this step did not bring (cannot last)
            time.sleep(0.001)
            return
        rows = [self._row(p) for p in step.pieces]
        try:
            if step.loads:
                self.runner.load_blocks(step.loads)
            results = self.runner.step(step.copies, rows)
        except Exception as e:  # one bad step ends the jobs in it, never the server
            self._report("a step failed", e)
            # Ended before `update`, so that nothing this step half-wrote is entered in the prefix tree.
            for job in {id(p.seq): self._choices[p.seq].job for p in step.pieces if p.seq in self._choices}.values():
                self._fail(job, Failed(f"the model failed on this request: {e}"))
            self.scheduler.update(step)
            return
        self.steps_total += 1
        # A checked draft's result is the drafted tokens accepted, then the token sampled after them.
        entered = self.scheduler.update(step, [result.tokens[:-1] for result in results])
        if self.disk is not None:
            # Now, before a later step can take the block back: it is copied here and written by the disk's thread.
            for seq, i, tokens in entered:
                self.disk.save(tokens, seq.block_keys, i, lambda b=seq.blocks[i]: self.runner.block_tensor(b))
        for piece, result in zip(step.pieces, results):
            if piece.seq in self._choices:
                self._absorb(piece, result)

    def _draft(self) -> None:
        """Give each decoding sequence that speculates its draft for the next step (none while drafting is paused),
        in order of arrival, while the step's rows stay within `MAX_STEP_ROWS`."""
        decoding = [seq for seq in self.scheduler.running if not seq.prefilling]
        budget = MAX_STEP_ROWS - len(decoding)
        for seq in decoding:
            choice = self._choices.get(seq)
            if budget <= 0:
                break
            if choice is not None and choice.speculation is not None:
                room = choice.job.max_tokens - len(seq.generated) - 1  # a check yields one token beyond its draft
                seq.draft = choice.speculation.next_draft(seq.tokens, min(room, budget))
                budget -= len(seq.draft)

    def _row(self, piece) -> Row:
        seq = piece.seq
        end = piece.start + piece.n
        # Echoed prompt log-probabilities: each fed prompt token scores the prompt token after it.
        scored = seq.tokens[piece.start + 1 : min(end + 1, seq.prompt_len)] if piece.all_logits else []
        sampler = self._choices[seq].sampler
        reads_history = sampler.controls is not None or sampler.constraint is not None
        if piece.draft:
            history = seq.tokens[: piece.start + 1] if sampler.controls is not None else []
            return Row(seq.tokens[piece.start : piece.start + 1], piece.start, list(seq.blocks), sampler=sampler,
                       draft=list(piece.draft), history=history)
        history = seq.tokens[:end] if reads_history and piece.sample else []
        return Row(seq.tokens[piece.start : end], piece.start, list(seq.blocks), scored, sampler.top_logprobs or 0,
                   sampler if piece.sample else None, history=history)

    def _absorb(self, piece, result: Result) -> None:
        seq = piece.seq
        choice = self._choices[seq]
        if piece.all_logits and seq.prompt_logprobs:
            # The first prompt token has no log-probability; each piece of a long prompt adds the next ones.
            head = [TokenLogprob(seq.tokens[0], None)] if piece.start == 0 else []
            scored = seq.tokens[piece.start + 1 : piece.start + 1 + len(result.fed_logprobs)]
            fed = [TokenLogprob(t, lp, top) for t, (lp, top) in zip(scored, result.fed_logprobs)]
            choice.job.emit(PromptLogprobs(choice.index, head + fed))
            if piece.start + piece.n >= seq.prompt_len:
                seq.prompt_logprobs = False
        if piece.draft and choice.speculation is not None:
            accepted = len(result.tokens) - 1
            choice.speculation.record(len(piece.draft), accepted)
            choice.job.drafted += len(piece.draft)
            choice.job.accepted += accepted
            self.drafted_tokens_total += len(piece.draft)
            self.accepted_tokens_total += accepted
        text = ""
        for i, token in enumerate(result.tokens):
            seq.append(token)
            self.generation_tokens_total += 1
            if token in self.stop_ids and (not choice.job.ignore_eos or choice.sampler.constraint is not None):
                self._end(seq, choice, text + choice.text.finish(), "stop")
                return
            if choice.job.logprobs is not None:
                choice.pending.append(TokenLogprob(token, result.logprobs[i], result.tops[i]))
            more, stopped = choice.text.push(token)
            text += more
            if stopped:
                self._end(seq, choice, text, "stop")
                return
            if len(seq.generated) >= choice.job.max_tokens:
                self._end(seq, choice, text + choice.text.finish(), "length")
                return
        if text:
            choice.job.emit(Delta(choice.index, text, choice.pending))
            choice.pending = []

    def _end(self, seq: SequenceState, choice: _Choice, text: str, reason: str) -> None:
        self.scheduler.finish(seq)
        del self._choices[seq]
        job = choice.job
        job.emit(Delta(choice.index, text, choice.pending, reason))
        choice.pending = []
        job.remaining -= 1
        if job.remaining == 0:
            first = job.sequences[0]
            job.emit(Done(len(job.prompt), sum(len(s.generated) for s in job.sequences), first.cached_tokens or 0,
                          first.disk_tokens if self.disk is not None else None,
                          job.drafted if self.speculate else None, job.accepted if self.speculate else None))

    def stats(self) -> Dict[str, float]:
        """Gauges and counters for /metrics."""
        s = self.scheduler
        pool = s.pool
        out = {
            "requests_running": len({id(self._choices[q].job) for q in list(s.running) if q in self._choices}),
            "requests_waiting": self.waiting_jobs(),
            "sequences_running": len(s.running),
            "sequences_waiting": len(s.waiting),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "prefix_cache_reused_tokens_total": s.prefix_tokens_reused,
            "preemptions_total": self.preemptions_total,
            "steps_total": self.steps_total,
        }
        if self.speculate:
            out.update({"speculative_drafted_tokens_total": self.drafted_tokens_total,
                        "speculative_accepted_tokens_total": self.accepted_tokens_total})
        if pool is not None:
            per_block = self.runner.cache.nbytes // pool.num_blocks
            out.update({
                "cache_block_size": pool.block_size,
                "cache_blocks_total": pool.num_blocks,
                "cache_blocks_used": pool.used,
                "cache_blocks_free": pool.available,
                "cache_blocks_cached": len(pool.evictable),
                "cache_bytes_used": pool.used * per_block,
                "cache_bytes_free": pool.available * per_block,
            })
        if self.disk is not None:
            out.update(self.disk.stats())
        return out
