"""Which sequences run at each step, which wait, and which KV-cache blocks they hold: continuous batching.

Plain Python, testable without a model. A step runs every sequence that is decoding (one token each, at
its own position) and, within a budget of prompt tokens per step, the next chunk of prompts still being
read, so a long prompt never stalls the streams already running. A sequence joins at the next step after
it arrives, if there is room (`max_running` sequences, and KV blocks for its prompt), and leaves as soon
as it is done. It then lets its blocks go, but they stay cached for a later sequence with the same prefix
(llama/server/blocks.py).

When a decoding sequence needs a block and none is left, the sequence that arrived last is preempted:
its blocks are released (cached, so they may well still be there) and it waits at the front of the queue
to be recomputed from its tokens, prompt and generated alike; its sampling goes on where it stopped. A
sequence that could never fit is refused before it is queued (`check_fits`).

With speculation, the engine gives a decoding sequence a draft (`SequenceState.draft`) before the step: its piece
feeds the newest token and the draft after it, and only the tokens the model keeps count as computed; the blocks
taken for the rest are let go (`update`). Drafts take only free blocks, never cached ones, and never preempt.

With a disk cache (llama/server/disk_cache.py), where a new sequence's walk of the prefix tree stops, the
next full blocks its prompt shares with blocks kept on disk are loaded into its own blocks instead of being
computed: the step carries them (`Step.loads`, opaque here) for the runner to write before it feeds anything.

Without a KV cache (`kv_cache=False`) no blocks are kept: every step feeds each sequence's whole prefix.
"""

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, List, Optional, Sequence, Tuple

from llama.server.blocks import BlockPool

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class SequenceState:
    """What the scheduler holds of one sequence being generated: its tokens, status, blocks and place in the prompt.

    Args:
        tokens: the prompt's token ids; sampled tokens are appended (`append`).
        prompt_logprobs: the logits of every prompt position are wanted (echoed log-probabilities), so
            none of its prompt may be taken from the cache.
        reuse_prefix: False computes every prompt token even where the cache holds them (a request's
            `cache_prompt: false`); its own blocks still enter the cache for later sequences.
        after: a sequence with the same prompt (another choice of one request) whose prompt should be
            computed first, so that this one reuses its blocks instead of computing them again.
    """

    tokens: List[int]
    prompt_logprobs: bool = False
    reuse_prefix: bool = True
    after: Optional["SequenceState"] = None
    seq_id: int = field(default_factory=itertools.count().__next__)
    status: str = WAITING
    prompt_len: int = 0
    computed: int = 0  # positions whose keys and values are in its blocks
    blocks: List[int] = field(default_factory=list)
    cached_tokens: Optional[int] = None  # prompt tokens taken from the cache when it was first admitted
    preemptions: int = 0
    block_keys: List[str] = field(default_factory=list)  # the disk cache's keys of its first full blocks, once computed
    disk_tokens: int = 0  # of `cached_tokens`, those loaded from disk
    draft: List[int] = field(default_factory=list)  # tokens to check after the newest in the next step (speculation)

    def __post_init__(self):
        self.tokens = list(self.tokens)
        self.prompt_len = len(self.tokens)

    def append(self, token: int) -> None:
        self.tokens.append(token)

    @property
    def generated(self) -> List[int]:
        return self.tokens[self.prompt_len :]

    @property
    def prefilling(self) -> bool:
        """More than the newest token is still to be fed."""
        return len(self.tokens) - self.computed > 1


@dataclass
class Piece:
    """Tokens of one sequence fed in a step: `seq.tokens[start : start + n]`, at positions start .. start + n - 1.

    A piece with a draft feeds the newest token and then the draft (n is 1 + its length); `update` is told which
    drafted tokens the model accepted, and only their positions stay computed.
    """

    seq: SequenceState
    start: int
    n: int
    sample: bool  # the piece reaches the last known token: a new token is sampled from its last logits
    all_logits: bool  # the logits of every position fed are wanted (prompt log-probabilities)
    draft: List[int] = field(default_factory=list)


@dataclass
class Step:
    """What one step does: load blocks from disk and copy block prefixes (prefix reuse), then feed the pieces."""

    copies: List[Tuple[int, int, int]] = field(default_factory=list)  # (source block, destination block, positions)
    loads: List[Tuple[int, Any]] = field(default_factory=list)  # (destination block, its keys and values from disk)
    pieces: List[Piece] = field(default_factory=list)
    preempted: List[SequenceState] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.pieces)


class Scheduler:
    """Continuous batching over one KV-cache budget shared by every sequence.

    Args:
        num_blocks, block_size: the KV cache's blocks (ignored without a cache).
        max_running: sequences decoded together (`--parallel`).
        prefill_chunk: prompt tokens fed per step, across all sequences still reading their prompts.
        kv_cache: False feeds every sequence's whole prefix at every step, keeping no blocks.
        disk: where full blocks the prefix tree lacks may be found (llama/server/disk_cache.py's `DiskCache`, whose
            `load(tokens, keys, first, last)` returns the contents of consecutive full blocks from `first`); None:
            nowhere.
    """

    def __init__(self, num_blocks: int, block_size: int, max_running: int, prefill_chunk: int, kv_cache: bool = True,
                 disk=None):
        if max_running < 1 or prefill_chunk < 1:
            raise ValueError(f"max_running and prefill_chunk must be at least 1, not {max_running} and {prefill_chunk}")
        self.pool = BlockPool(num_blocks, block_size) if kv_cache else None
        self.disk = disk if kv_cache else None
        self.max_running, self.prefill_chunk = max_running, prefill_chunk
        self.waiting: Deque[SequenceState] = deque()
        self.running: List[SequenceState] = []  # in order of arrival
        self._pinned: List[int] = []  # copy sources held until the step that copies them has run
        self.prefix_tokens_reused = 0  # over the scheduler's life, for /metrics

    def check_fits(self, prompt_len: int, max_new: int) -> Optional[str]:
        """Why a sequence of `prompt_len` tokens that may generate `max_new` more could never run, or None."""
        if self.pool is None:
            return None
        positions = prompt_len + max_new - 1  # the last token is sampled, never fed
        need = self.pool.blocks_for(positions)
        if need > self.pool.num_blocks:
            bs = self.pool.block_size
            return (f"{prompt_len} prompt tokens and up to {max_new} generated need {need * bs} positions of KV cache, "
                    f"more than the {self.pool.num_blocks * bs} the server holds (--kv-cache-size)")
        return None

    def most_new_tokens(self, prompt_len: int) -> Optional[int]:
        """The most tokens a sequence of `prompt_len` tokens could generate in the whole KV cache, None without
        a limit: exactly the `max_new` that `check_fits` passes."""
        if self.pool is None:
            return None
        return self.pool.num_blocks * self.pool.block_size - prompt_len + 1  # the last token is never fed

    def add(self, seq: SequenceState) -> None:
        """Queue a sequence; it joins the batch at a later step."""
        assert seq.status == WAITING
        self.waiting.append(seq)

    def abort(self, seq: SequenceState) -> None:
        """Drop a sequence wherever it is, letting its blocks go."""
        if seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status == RUNNING:
            self.running.remove(seq)
            self._let_go(seq)
        seq.status = FINISHED

    def finish(self, seq: SequenceState) -> None:
        """A running sequence is done: it leaves the batch and lets its blocks go (they stay cached)."""
        self.abort(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> Step:
        """Decide the next step: make room for the decoding sequences, admit waiting ones, cut prompt chunks."""
        step = Step()
        if self.pool is not None:
            self._grow_or_preempt(step)
        self._admit(step)
        budget = self.prefill_chunk
        for seq in self.running:
            if self.pool is None:  # the whole prefix, every step
                step.pieces.append(Piece(seq, 0, len(seq.tokens), sample=True, all_logits=seq.prompt_logprobs))
            elif not seq.prefilling:
                step.pieces.append(Piece(seq, seq.computed, 1 + len(seq.draft), sample=True, all_logits=False,
                                         draft=seq.draft))
            elif budget > 0:
                n = min(len(seq.tokens) - seq.computed, budget)
                budget -= n
                done = seq.computed + n == len(seq.tokens)
                wanted = seq.prompt_logprobs and seq.computed < seq.prompt_len
                step.pieces.append(Piece(seq, seq.computed, n, sample=done, all_logits=wanted))
        return step

    def update(self, step: Step, accepted: Sequence[Sequence[int]] = ()) -> List[Tuple[SequenceState, int, List[int]]]:
        """After the step has run: its positions are computed; full blocks enter the prefix tree.

        Args:
            accepted: for each piece in order, the drafted tokens the model accepted (a piece without a draft has
                none): their positions are computed too, and the blocks they fill enter the tree. The engine
                appends them to the sequence as it takes each sampled token, and may stop before the last.

        Returns:
            (sequence, i, tokens) for each block that entered the tree now: the sequence's i-th block, and the
            tokens that fill it (the sequence's and its accepted ones).
        """
        if self._pinned:
            self.pool.release(self._pinned)
            self._pinned = []
        entered = []
        for k, piece in enumerate(step.pieces):
            seq = piece.seq
            if seq.status != RUNNING or self.pool is None:
                continue
            kept = list(accepted[k]) if piece.draft and k < len(accepted) else []
            seq.computed = piece.start + (1 + len(kept) if piece.draft else piece.n)
            tokens = seq.tokens + kept if kept else seq.tokens  # no copy of a long sequence where none was kept
            entered += [(seq, i, tokens) for i in self.pool.commit(seq.blocks, tokens, seq.computed)]
            if piece.draft:  # the blocks past the next position held only rejected tokens
                keep = self.pool.blocks_for(seq.computed + 1)
                self.pool.release(seq.blocks[keep:])
                del seq.blocks[keep:]
        for seq in self.running:
            seq.draft = []
        return entered

    def _grow_or_preempt(self, step: Step) -> None:
        """Give every decoding sequence a block for its next position, preempting the newest when none is left."""
        for seq in list(self.running):
            if seq.status != RUNNING or seq.prefilling or len(seq.blocks) * self.pool.block_size > seq.computed:
                continue
            while self.pool.available < 1 and seq.status == RUNNING:
                self._preempt(self.running[-1], step)
            if seq.status == RUNNING:
                seq.blocks += self.pool.allocate(1)
        for seq in self.running:  # then room for drafts, from free blocks only
            if seq.draft and not seq.prefilling:
                bs = self.pool.block_size
                more = min(self.pool.blocks_for(seq.computed + 1 + len(seq.draft)) - len(seq.blocks), len(self.pool.free))
                if more > 0:
                    seq.blocks += self.pool.allocate(more)
                seq.draft = seq.draft[: len(seq.blocks) * bs - seq.computed - 1]

    def _preempt(self, seq: SequenceState, step: Step) -> None:
        self.running.remove(seq)
        self._let_go(seq)
        seq.status, seq.preemptions = WAITING, seq.preemptions + 1
        self.waiting.appendleft(seq)
        step.preempted.append(seq)

    def _let_go(self, seq: SequenceState) -> None:
        if self.pool is not None:
            # A sequence may end before the last drafted token the model accepted: only its tokens' positions count.
            self.pool.keep_partial(seq.blocks, seq.tokens, min(seq.computed, len(seq.tokens)))
            self.pool.release(seq.blocks)
        seq.blocks, seq.computed = [], 0

    def _admit(self, step: Step) -> None:
        """Move waiting sequences into the batch, first come first served, while there is room."""
        skipped: List[SequenceState] = []
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if seq.after is not None and seq.after.status != FINISHED and (
                    seq.after.status == WAITING or seq.after.computed < seq.after.prompt_len):
                skipped.append(self.waiting.popleft())  # its sibling's prompt first; others may go meanwhile
                continue
            if self.pool is not None and not self._place(seq, step):
                break  # no room: it waits, and so does everyone behind it
            self.waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)
        self.waiting.extendleft(reversed(skipped))

    def _place(self, seq: SequenceState, step: Step) -> bool:
        """Give a sequence blocks for every token it has, reusing cached prefixes; False if they do not fit."""
        pool = self.pool
        # At least the last token is fed: its logits choose the next one.
        limit = 0 if seq.prompt_logprobs or not seq.reuse_prefix else len(seq.tokens) - 1
        full, partial = pool.lookup(seq.tokens, limit)
        new = pool.blocks_for(len(seq.tokens)) - len(full)
        # Cached blocks nobody holds count as available until this sequence takes them.
        taken = [b for b in full + ([partial[0]] if partial else []) if pool.blocks[b].refs == 0]
        if new > pool.available - len(taken):
            return False
        loaded = []
        if self.disk is not None and len(full) < limit // pool.block_size:
            # Only once the sequence is sure to be placed: a waiting one would read the same files every step.
            loaded = self.disk.load(seq.tokens, seq.block_keys, len(full), limit // pool.block_size)
            if loaded:
                partial = None  # it was the start of the block after `full`, which now comes from disk
        pool.hold(full)
        reused = (len(full) + len(loaded)) * pool.block_size
        if partial is not None:
            pool.hold([partial[0]])  # until the copy has run, so that allocating cannot take it back
            self._pinned.append(partial[0])
        seq.blocks = full + pool.allocate(new)
        step.loads += zip(seq.blocks[len(full) : len(full) + len(loaded)], loaded)
        if partial is not None:
            step.copies.append((partial[0], seq.blocks[len(full)], partial[1]))
            reused += partial[1]
        seq.computed = reused
        if seq.cached_tokens is None:
            seq.cached_tokens = min(reused, seq.prompt_len)
            seq.disk_tokens = min(len(loaded) * pool.block_size, seq.cached_tokens)
        self.prefix_tokens_reused += reused
        return True
