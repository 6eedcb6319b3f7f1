"""The server's batched step against today's path: rows at their own positions give each row's own logits.

`Transformer.forward(..., input_pos=...)` writes every row at positions of its own, into a contiguous
`KVCache` or a paged pool whose blocks are scattered and shared; per row, its logits must equal those of
the plain path (`forward(tokens, start_pos, cache)`, and the uncached pass) within 1e-5 in float32.
"""

import pytest
import torch

from helpers import build
from llama.kv_cache import KVCache, PagedKVCache
from llama.model import rope_cis


def _rows(model, lengths, seed=5):
    """Random token rows of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.vocab_size, (n,), generator=g) for n in lengths]


def _reference(model, row):
    """Today's uncached path: logits at every position of one row, (len, vocab)."""
    return model(row[None])[0]


def test_rotations_of_a_row_among_others_equal_its_own_bit_for_bit():
    positions = torch.tensor([[0, 1, 2, 3], [17, 18, 19, 20], [63, 64, 65, 66]])
    at = rope_cis(16, 10000.0, positions)
    for i, row in enumerate(positions.tolist()):
        assert torch.equal(at[i], rope_cis(16, 10000.0, torch.arange(row[0], row[0] + len(row))))


def test_plain_path_is_unchanged_by_the_positions_path(gqa_ckpt):
    """forward(tokens, start_pos, cache) still gives the uncached logits: the int path is the old code."""
    model = build(gqa_ckpt).model
    (row,) = _rows(model, [20])
    with torch.inference_mode():
        cache = model.new_kv_cache(1, 20)
        cached = torch.cat([model(row[None, :12], 0, cache)] + [model(row[None, p : p + 1], p, cache) for p in range(12, 20)], 1)
        torch.testing.assert_close(cached[0], _reference(model, row), rtol=0, atol=1e-5)


def test_rows_at_different_positions_in_one_contiguous_cache(tiny_ckpt):
    """Rows of lengths 5, 17 and 30 prefilled together (right-padded), then decoded and chunk-fed together."""
    model = build(tiny_ckpt).model
    lengths = [5, 17, 30]
    rows = _rows(model, [n + 8 for n in lengths])
    with torch.inference_mode():
        refs = [_reference(model, r) for r in rows]
        cache = model.new_kv_cache(3, 48)
        # Right padding writes junk past each row's prompt; it is hidden from every query before it and
        # overwritten when the row reaches those positions.
        tokens = torch.stack([torch.cat([r[:n], torch.zeros(30 - n, dtype=torch.long)]) for r, n in zip(rows, lengths)])
        logits = model(tokens, cache=cache, input_pos=torch.arange(30).expand(3, 30))
        for i, n in enumerate(lengths):
            torch.testing.assert_close(logits[i, :n], refs[i][:n], rtol=0, atol=1e-5)
        # Four one-token steps, each row at its own position.
        for step in range(4):
            pos = torch.tensor([[n + step] for n in lengths])
            logits = model(torch.stack([r[n + step : n + step + 1] for r, n in zip(rows, lengths)]), cache=cache, input_pos=pos)
            for i, n in enumerate(lengths):
                torch.testing.assert_close(logits[i, 0], refs[i][n + step], rtol=0, atol=1e-5)
        # A four-token chunk per row, from each row's own position.
        start = [n + 4 for n in lengths]
        pos = torch.stack([torch.arange(s, s + 4) for s in start])
        logits = model(torch.stack([r[s : s + 4] for r, s in zip(rows, start)]), cache=cache, input_pos=pos)
        for i, s in enumerate(start):
            torch.testing.assert_close(logits[i], refs[i][s : s + 4], rtol=0, atol=1e-5)


def _scattered_tables(n_rows, blocks_per_row, num_blocks, seed=0):
    """Disjoint block tables drawn in random order from the pool."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [perm[i * blocks_per_row : (i + 1) * blocks_per_row] for i in range(n_rows)]


def test_paged_rows_with_scattered_and_shared_blocks_give_their_own_logits(tiny_ckpt):
    """Rows whose blocks lie anywhere in the pool, two of them sharing their first blocks (a common prefix
    written once), decoded together at different positions: each row's logits are its own."""
    model = build(tiny_ckpt).model
    bs = 4
    pool = model.new_paged_kv_cache(num_blocks=40, block_size=bs)
    tables = _scattered_tables(3, 10, 40)
    rows = _rows(model, [36, 36, 36])
    rows[1][:8] = rows[0][:8]  # rows 0 and 1 share their first two blocks
    tables[1][:2] = tables[0][:2]
    lengths = [9, 22, 13]
    with torch.inference_mode():
        refs = [_reference(model, r) for r in rows]
        # Prefill each row alone in chunks of 5 (row 1 only after its shared prefix, as a server reuses it).
        for i, (r, n) in enumerate(zip(rows, lengths)):
            start = 8 if i == 1 else 0
            for s in range(start, n, 5):
                e = min(s + 5, n)
                pos = torch.arange(s, e)[None]
                layers = pool.for_step(torch.tensor([tables[i]]), pos)
                logits = model(r[None, s:e], cache=layers, input_pos=pos)
                torch.testing.assert_close(logits[0], refs[i][s:e], rtol=0, atol=1e-5)
        # Then decode all three together, each at its own position, reading only the blocks in use so far.
        for step in range(10):
            pos = torch.tensor([[n + step] for n in lengths])
            used = (max(lengths) + step) // bs + 1
            layers = pool.for_step(torch.tensor([t[:used] for t in tables]), pos)
            logits = model(torch.stack([r[n + step : n + step + 1] for r, n in zip(rows, lengths)]), cache=layers, input_pos=pos)
            for i, n in enumerate(lengths):
                torch.testing.assert_close(logits[i, 0], refs[i][n + step], rtol=0, atol=1e-5)


def test_a_copied_block_prefix_serves_as_the_prefix_itself(gqa_ckpt):
    """A sequence that copies the first positions of another's block continues as if it had fed them."""
    model = build(gqa_ckpt).model
    pool = model.new_paged_kv_cache(num_blocks=8, block_size=8)
    (row,) = _rows(model, [20])
    with torch.inference_mode():
        ref = _reference(model, row)
        pos = torch.arange(0, 12)[None]
        model(row[None, :12], cache=pool.for_step(torch.tensor([[3, 5]]), pos), input_pos=pos)
        pool.copy_prefix(5, 6, 3)  # positions 8, 9, 10 of the first row, into block 6
        pos = torch.arange(11, 20)[None]
        logits = model(row[None, 11:20], cache=pool.for_step(torch.tensor([[3, 6, 7]]), pos), input_pos=pos)
        torch.testing.assert_close(logits[0], ref[11:20], rtol=0, atol=1e-5)


def test_positions_outside_the_cache_are_refused(gqa_ckpt):
    model = build(gqa_ckpt).model
    with torch.inference_mode():
        with pytest.raises(ValueError, match="overflow"):
            model(torch.zeros((1, 2), dtype=torch.long), cache=model.new_kv_cache(1, 8), input_pos=torch.tensor([[7, 8]]))
        pool = model.new_paged_kv_cache(num_blocks=4, block_size=4)
        with pytest.raises(ValueError, match="overflow"):
            pool.for_step(torch.tensor([[0, 1]]), torch.tensor([[8]]))
        # Without a cache the positions path is the uncached pass: the whole prefix, from position 0 in every row.
        tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
        assert torch.equal(model(tokens, input_pos=torch.arange(3).expand(2, 3)), model(tokens))
        with pytest.raises(ValueError, match="whole prefix must be fed.*not from position 3"):
            model(tokens, input_pos=torch.arange(3, 6)[None])
        with pytest.raises(ValueError, match=r"not from position \[0, 1\]"):
            model(tokens, input_pos=torch.tensor([[0, 1, 2], [1, 2, 3]]))
    assert isinstance(model.new_kv_cache(1, 4)[0], KVCache) and isinstance(pool, PagedKVCache)
    assert pool.nbytes == model.kv_cache_nbytes(1, 16)
