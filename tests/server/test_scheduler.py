"""The server's scheduler and KV blocks, without a model.

A fake KV cache stands in for the model: each block position holds the token id whose "keys" were
written there. Every step then checks what a model would need, that each sequence reads exactly its own
tokens at positions 0 .. start + n - 1 through its block table, whatever it shares, copies or recomputes.
"""

import random

import pytest

from llama.server.blocks import BlockPool
from llama.server.scheduler import FINISHED, RUNNING, WAITING, Scheduler, SequenceState


class FakeCache:
    """Token ids in place of keys and values, written and read as the runner would."""

    def __init__(self, pool: BlockPool):
        self.bs = pool.block_size
        self.slots = [[None] * pool.block_size for _ in range(pool.num_blocks)]

    def run(self, step):
        for src, dst, n in step.copies:
            self.slots[dst][:n] = self.slots[src][:n]
        for piece in step.pieces:
            seq = piece.seq
            for p in range(piece.start, piece.start + piece.n):
                self.slots[seq.blocks[p // self.bs]][p % self.bs] = seq.tokens[p]
            seen = [self.slots[seq.blocks[p // self.bs]][p % self.bs] for p in range(piece.start + piece.n)]
            assert seen == seq.tokens[: piece.start + piece.n], f"sequence {seq.seq_id} reads another's keys"


def run_step(sched, cache, next_token=lambda seq: 7, max_new=None):
    """One step: schedule, 'run', update, append sampled tokens and finish sequences that are done."""
    step = sched.schedule()
    cache.run(step)
    sched.update(step)
    for piece in step.pieces:
        if piece.sample and piece.seq.status == RUNNING:
            piece.seq.append(next_token(piece.seq))
            if max_new is not None and len(piece.seq.generated) >= max_new:
                sched.finish(piece.seq)
    return step


def check_accounting(sched):
    """Every held reference belongs to a running sequence (or a pinned copy source); nothing is lost."""
    pool = sched.pool
    refs = [0] * pool.num_blocks
    for seq in sched.running:
        for b in seq.blocks:
            refs[b] += 1
    assert [b.refs for b in pool.blocks] == refs
    free, evictable = set(pool.free), set(pool.evictable)
    assert not free & evictable and len(free) == len(pool.free)
    for b in pool.blocks:
        assert (b.id in free) == (b.refs == 0 and not b.cached)
        assert (b.id in evictable) == (b.refs == 0 and b.cached)
    for seq in sched.waiting:
        assert seq.status == WAITING and not seq.blocks


def test_a_sequence_reuses_the_full_blocks_of_an_earlier_one_and_copies_the_rest():
    sched = Scheduler(num_blocks=16, block_size=4, max_running=4, prefill_chunk=64)
    cache = FakeCache(sched.pool)
    first = SequenceState(list(range(100, 111)))  # 11 tokens: two full blocks and three positions
    sched.add(first)
    for _ in range(3):
        run_step(sched, cache)
    held = list(first.blocks)
    sched.finish(first)
    assert first.cached_tokens == 0 and sched.pool.used == 0
    # Fed: the prompt and two of the three sampled tokens (the last is never fed): 13 positions.
    second = SequenceState(list(range(100, 111)) + [7, 7, 9])
    sched.add(second)
    step = run_step(sched, cache)
    assert second.cached_tokens == 13  # 3 full blocks shared, 1 position copied from the 4th
    assert second.blocks[:3] == held[:3]
    assert step.copies == [(held[3], second.blocks[3], 1)] and second.blocks[3] != held[3]
    check_accounting(sched)


def test_reuse_compares_token_ids_and_always_feeds_the_last_token():
    sched = Scheduler(num_blocks=16, block_size=4, max_running=4, prefill_chunk=64)
    cache = FakeCache(sched.pool)
    a = SequenceState([1, 2, 3, 4, 5, 6, 7, 8])
    sched.add(a)
    run_step(sched, cache)
    sched.finish(a)
    same = SequenceState([1, 2, 3, 4, 5, 6, 7, 8])  # all cached, but the last token must still be fed
    differs = SequenceState([1, 2, 3, 4, 5, 0, 7, 8])
    sched.add(same)
    sched.add(differs)
    step = run_step(sched, cache)
    assert (same.cached_tokens, differs.cached_tokens) == (7, 5)
    assert [(p.start, p.n) for p in step.pieces] == [(7, 1), (5, 3)]
    check_accounting(sched)


def same_prompt_again(**second):
    """A scheduler that computed a prompt of 8 tokens, then the step that feeds a second sequence the same prompt,
    made with `second`'s options: (scheduler, cache, second sequence, step)."""
    sched = Scheduler(num_blocks=16, block_size=4, max_running=4, prefill_chunk=64)
    cache = FakeCache(sched.pool)
    sched.add(SequenceState([1, 2, 3, 4, 5, 6, 7, 8]))
    run_step(sched, cache)
    b = SequenceState([1, 2, 3, 4, 5, 6, 7, 8], **second)
    sched.add(b)
    return sched, cache, b, run_step(sched, cache)


def test_echoed_prompt_logprobs_reuse_nothing():
    _, _, b, step = same_prompt_again(prompt_logprobs=True)
    assert b.cached_tokens == 0 and step.pieces[-1].all_logits and step.pieces[-1].n == 8


def test_a_sequence_that_may_not_reuse_computes_its_whole_prompt_and_still_leaves_it_cached():
    sched, cache, b, step = same_prompt_again(reuse_prefix=False)
    assert b.cached_tokens == 0 and (step.pieces[-1].start, step.pieces[-1].n) == (0, 8) and not step.copies
    assert not step.pieces[-1].all_logits
    c = SequenceState([1, 2, 3, 4, 5, 6, 7, 8, 9])
    sched.add(c)
    run_step(sched, cache)
    assert c.cached_tokens == 8
    check_accounting(sched)


def test_two_sequences_computing_the_same_prefix_end_up_sharing_one_copy():
    sched = Scheduler(num_blocks=16, block_size=4, max_running=4, prefill_chunk=64)
    cache = FakeCache(sched.pool)
    a, b = SequenceState([5] * 9), SequenceState([5] * 9)
    sched.add(a)
    sched.add(b)
    run_step(sched, cache)  # both prefilled in the same step: neither could reuse the other
    assert a.cached_tokens == b.cached_tokens == 0
    assert a.blocks[:2] == b.blocks[:2]  # the second's full blocks were swapped for the first's
    assert sched.pool.blocks[a.blocks[0]].refs == 2
    run_step(sched, cache)
    check_accounting(sched)


def test_continuous_batching_joins_at_the_next_step_and_chunks_long_prompts():
    sched = Scheduler(num_blocks=64, block_size=4, max_running=4, prefill_chunk=8)
    cache = FakeCache(sched.pool)
    short = SequenceState([1, 2, 3])
    sched.add(short)
    step = run_step(sched, cache)
    assert [(p.seq, p.n, p.sample) for p in step.pieces] == [(short, 3, True)]
    long = SequenceState(list(range(10, 30)))  # 20 tokens: three steps of at most 8
    sched.add(long)
    fed = []
    for _ in range(3):
        step = run_step(sched, cache)
        by_seq = {p.seq: p for p in step.pieces}
        assert by_seq[short].n == 1 and by_seq[short].sample  # the running stream keeps flowing
        fed.append((by_seq[long].start, by_seq[long].n, by_seq[long].sample))
    assert fed == [(0, 8, False), (8, 8, False), (16, 4, True)]
    step = run_step(sched, cache)
    assert [(p.start, p.n) for p in step.pieces] == [(short.computed - 1, 1), (20, 1)]
    check_accounting(sched)


def test_the_batch_is_capped_and_the_queue_is_first_come_first_served():
    sched = Scheduler(num_blocks=64, block_size=4, max_running=2, prefill_chunk=64)
    cache = FakeCache(sched.pool)
    seqs = [SequenceState([i, i + 1]) for i in range(4)]
    for s in seqs:
        sched.add(s)
    run_step(sched, cache)
    assert sched.running == seqs[:2] and list(sched.waiting) == seqs[2:]
    sched.finish(seqs[1])
    run_step(sched, cache)
    assert sched.running == [seqs[0], seqs[2]]


def test_a_full_cache_makes_newcomers_wait_and_preempts_the_newest():
    # 5 blocks of 4: two sequences of 8 prompt tokens take 4 blocks; as they grow they need more.
    sched = Scheduler(num_blocks=5, block_size=4, max_running=4, prefill_chunk=64)
    cache = FakeCache(sched.pool)
    a, b, c = SequenceState(list(range(8))), SequenceState(list(range(20, 28))), SequenceState(list(range(40, 48)))
    for s in (a, b, c):
        sched.add(s)
    token = lambda s: 1000 + len(s.tokens)  # noqa: E731
    run_step(sched, cache, token)
    assert sched.running == [a, b] and list(sched.waiting) == [c]  # c's prompt does not fit
    preempted = []
    for _ in range(8):
        preempted += run_step(sched, cache, token).preempted
        check_accounting(sched)
    assert b in preempted and a not in preempted  # the newest goes first
    assert b.preemptions >= 1 and b.status in (RUNNING, WAITING)
    # a ran on undisturbed, one token per step.
    assert a.generated == [1000 + n for n in range(8, 17)]


def test_a_preempted_sequence_is_recomputed_from_its_tokens_and_goes_on():
    sched = Scheduler(num_blocks=5, block_size=4, max_running=2, prefill_chunk=64)
    cache = FakeCache(sched.pool)
    a, b = SequenceState(list(range(7))), SequenceState(list(range(50, 57)))
    sched.add(a)
    sched.add(b)
    counter = iter(range(10**6))
    for _ in range(30):
        run_step(sched, cache, next_token=lambda s: 500 + next(counter), max_new=6)
        check_accounting(sched)
        if a.status == b.status == FINISHED:
            break
    assert a.status == b.status == FINISHED and b.preemptions >= 1
    assert len(a.generated) == len(b.generated) == 6  # nothing sampled twice, nothing lost
    assert sched.pool.used == 0


def test_a_sequence_that_could_never_fit_is_named():
    sched = Scheduler(num_blocks=4, block_size=4, max_running=2, prefill_chunk=64)
    assert sched.check_fits(10, 7) is None  # 16 positions: exactly the cache
    assert "need 20 positions" in sched.check_fits(10, 8) and "--kv-cache-size" in sched.check_fits(10, 8)
    assert Scheduler(1, 1, 1, 1, kv_cache=False).check_fits(10**6, 10**6) is None


@pytest.mark.parametrize("num_blocks, block_size", [(4, 4), (5, 3), (1, 1), (16, 16)])
def test_the_most_new_tokens_are_exactly_what_check_fits_passes(num_blocks, block_size):
    """The server's default max_tokens (llama/server/http.py) in closed form, against check_fits itself."""
    sched = Scheduler(num_blocks=num_blocks, block_size=block_size, max_running=2, prefill_chunk=8)
    for prompt_len in range(1, num_blocks * block_size + 2):
        most = sched.most_new_tokens(prompt_len)
        assert most < 1 or sched.check_fits(prompt_len, most) is None
        assert sched.check_fits(prompt_len, most + 1) is not None
    assert Scheduler(1, 1, 1, 1, kv_cache=False).most_new_tokens(10**6) is None


def test_choices_of_one_request_wait_for_the_first_prompt_and_share_it():
    sched = Scheduler(num_blocks=32, block_size=4, max_running=4, prefill_chunk=6)
    cache = FakeCache(sched.pool)
    first = SequenceState(list(range(10)))
    others = [SequenceState(list(range(10)), after=first) for _ in range(2)]
    for s in [first] + others:
        sched.add(s)
    run_step(sched, cache)
    assert sched.running == [first]  # siblings wait while its prompt is read in chunks
    run_step(sched, cache)
    run_step(sched, cache)
    assert sched.running == [first] + others
    # Its full blocks are shared; the two positions of its last block, still being written, are recomputed.
    assert [s.cached_tokens for s in others] == [8, 8]
    check_accounting(sched)


def test_abort_lets_the_blocks_go_at_once():
    sched = Scheduler(num_blocks=8, block_size=4, max_running=2, prefill_chunk=64)
    cache = FakeCache(sched.pool)
    a, b = SequenceState(list(range(9))), SequenceState(list(range(9)))
    sched.add(a)
    run_step(sched, cache)
    sched.add(b)
    sched.abort(a)
    assert sched.pool.used == 0 and a.status == FINISHED
    sched.abort(b)  # still waiting
    assert not sched.has_work


def test_cached_blocks_are_taken_back_least_recently_released_leaf_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    a = pool.allocate(2)
    pool.commit(a, [1, 2, 3, 4], 4)
    pool.release(a)
    b = pool.allocate(2)
    pool.commit(b, [5, 6, 7, 8], 4)
    pool.release(b)
    assert pool.available == 4 and pool.used == 0
    assert pool.lookup([1, 2, 3, 4, 0], 5)[0] == a
    (taken,) = pool.allocate(1)
    assert taken == a[1]  # a's last block: released before b's, and a leaf
    assert pool.lookup([1, 2, 3, 4, 0], 5)[0] == a[:1] and pool.lookup([5, 6, 7, 8, 0], 5)[0] == b


def test_without_a_cache_every_step_feeds_the_whole_prefix():
    sched = Scheduler(num_blocks=1, block_size=1, max_running=2, prefill_chunk=1, kv_cache=False)
    a = SequenceState([1, 2, 3])
    sched.add(a)
    for n in (3, 4, 5):
        step = sched.schedule()
        assert [(p.start, p.n, p.sample) for p in step.pieces] == [(0, n, True)]
        sched.update(step)
        a.append(9)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_every_sequence_reading_its_own_tokens(seed):
    """Many sequences with shared prefixes, arriving, finishing and aborted at random, in a cache too
    small for all of them: every step each reads its own tokens, and no block is lost or held twice."""
    rng = random.Random(seed)
    sched = Scheduler(num_blocks=rng.choice([12, 20, 40]), block_size=rng.choice([1, 3, 4]),
                      max_running=rng.choice([1, 3, 5]), prefill_chunk=rng.choice([2, 7, 64]))
    cache = FakeCache(sched.pool)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    live, goals = [], {}
    for _ in range(150):
        if rng.random() < 0.3:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 5))]
            if sched.check_fits(len(tokens), 4) is None:
                seq = SequenceState(tokens)
                goals[seq] = rng.randrange(1, 5)
                sched.add(seq)
                live.append(seq)
        if live and rng.random() < 0.05:
            sched.abort(live.pop(rng.randrange(len(live))))
        step = sched.schedule()
        cache.run(step)
        sched.update(step)
        for piece in step.pieces:
            if piece.sample:
                piece.seq.append(rng.randrange(50))
                if len(piece.seq.generated) >= goals[piece.seq]:
                    sched.finish(piece.seq)
                    live.remove(piece.seq)
        check_accounting(sched)
    while sched.has_work:  # everything left finishes
        step = sched.schedule()
        assert step, "the scheduler stalled with work left"
        cache.run(step)
        sched.update(step)
        for piece in step.pieces:
            if piece.sample:
                piece.seq.append(1)
                if len(piece.seq.generated) >= goals[piece.seq]:
                    sched.finish(piece.seq)
        check_accounting(sched)
    assert sched.pool.used == 0


def test_a_draft_takes_free_blocks_for_its_step_and_lets_go_of_what_was_rejected():
    sched = Scheduler(num_blocks=8, block_size=2, max_running=2, prefill_chunk=16)
    seq = SequenceState([1, 2, 3])
    sched.add(seq)
    sched.update(sched.schedule())  # the prompt
    seq.append(4)
    seq.draft = [5, 6, 7, 8]
    step = sched.schedule()
    (piece,) = step.pieces
    assert (piece.start, piece.n, piece.draft) == (3, 5, [5, 6, 7, 8])
    assert len(seq.blocks) == 4  # positions 3 .. 7 fed
    entered = sched.update(step, [[5]])  # the model kept the newest token and one drafted token
    assert seq.computed == 5 and len(seq.blocks) == 3 and seq.draft == []  # room for position 5, no more
    assert sched.pool.used == 3
    assert [(i, tokens[i * 2 : i * 2 + 2]) for s, i, tokens in entered] == [(1, [3, 4])]  # full now, and entered


def test_a_draft_takes_no_block_another_sequence_needs():
    sched = Scheduler(num_blocks=4, block_size=2, max_running=2, prefill_chunk=16)
    a, b = SequenceState([1, 2, 3]), SequenceState([9, 8])
    for seq in (a, b):
        sched.add(seq)
    sched.update(sched.schedule())
    a.append(4)
    b.append(7)
    a.draft = [5, 6, 7]
    step = sched.schedule()
    assert all(s.status == RUNNING for s in (a, b)) and not step.preempted
    (pa, pb) = step.pieces
    assert pa.draft == [] and pa.n == 1  # a holds positions 0-3; the only free block went to b's next position
    assert len(b.blocks) == 2
