"""The KV cache's blocks as the scheduler sees them: which are free, who holds which, and which prefixes they hold.

Plain Python: no tensors. The blocks' keys and values live in the runner's `PagedKVCache`; here each block
is a number with a reference count and, once its positions are computed, the token ids they belong to.

Prefix reuse follows vLLM's automatic prefix caching, with exact comparisons instead of hashes: every
full block whose keys and values are computed is entered in a tree, under the block before it, keyed by
its token ids. A new sequence walks the tree from the root with its own ids and takes every full block
that matches (shared, not copied). Where the walk stops, the longest partial match among that node's
children (a full block, or the last, partial block of a sequence that ended) is copied into a fresh block
of its own, so reuse is exact to the token, as llama.cpp's slots are. A block nobody holds stays in the
tree, cached, until its memory is needed: then the least recently released leaf goes first.
"""

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

from llama.nn.session import common_prefix_len


class Block:
    """One block: its number in the pool, who holds it, and what it caches."""

    __slots__ = ("id", "refs", "tokens", "parent", "children")

    def __init__(self, block_id: int):
        self.id = block_id
        self.refs = 0
        self.tokens: Tuple[int, ...] = ()  # ids whose keys and values it holds; set when entered in the tree
        self.parent: Optional["Block"] = None  # in the tree; None while not entered
        self.children: Dict[Tuple[int, ...], "Block"] = {}

    @property
    def cached(self) -> bool:
        return self.parent is not None


class BlockPool:
    """`num_blocks` blocks of `block_size` positions, and the tree of the prefixes they hold.

    Args:
        num_blocks: blocks in the KV cache.
        block_size: positions per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs at least one block of one position, not {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.root = Block(-1)
        self.free: List[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        # Cached blocks nobody holds, least recently released first: memory that can be taken back.
        self.evictable: "OrderedDict[int, None]" = OrderedDict()

    @property
    def available(self) -> int:
        """Blocks that can be handed out now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.available

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    def lookup(self, tokens: Sequence[int], limit: int) -> Tuple[List[int], Optional[Tuple[int, int]]]:
        """What the cache holds of a sequence's first `limit` tokens.

        Returns:
            (full, partial): the cached full blocks that hold its first len(full) * block_size tokens, in
            order; and (block, n) when a further n tokens (less than a block, and within `limit`) can be
            copied from the first n positions of that block, else None.
        """
        bs = self.block_size
        node, full = self.root, []
        while (len(full) + 1) * bs <= limit:
            child = node.children.get(tuple(tokens[len(full) * bs : (len(full) + 1) * bs]))
            if child is None:
                break
            full.append(child.id)
            node = child
        rest = tokens[len(full) * bs : min(limit, (len(full) + 1) * bs)]
        best, best_n = None, 0
        for child in node.children.values():
            n = common_prefix_len(child.tokens, rest)
            if n > best_n:
                best, best_n = child, n
        return full, ((best.id, best_n) if best is not None else None)

    def hold(self, block_ids: Sequence[int]) -> None:
        """Take a reference to each of these blocks (cached ones found by `lookup`)."""
        for i in block_ids:
            block = self.blocks[i]
            if block.refs == 0:
                self.evictable.pop(i, None)
            block.refs += 1

    def allocate(self, n: int) -> List[int]:
        """n empty blocks, held once each; cached blocks nobody holds are taken back if need be.

        Raises:
            RuntimeError: fewer than n blocks are available (callers check `available` first).
        """
        if n > self.available:
            raise RuntimeError(f"asked for {n} KV blocks with {self.available} available")
        out = []
        for _ in range(n):
            block = self.blocks[self.free.pop()] if self.free else self._evict()
            block.refs = 1
            out.append(block.id)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds stays cached if it is in the tree, else is free.

        Released last block first, so that a sequence's later blocks are taken back before its earlier ones.
        """
        for i in reversed(block_ids):
            block = self.blocks[i]
            assert block.refs > 0, f"block {i} released more often than held"
            block.refs -= 1
            if block.refs == 0:
                if block.cached:
                    self.evictable[i] = None
                else:
                    self.free.append(i)

    def commit(self, blocks: List[int], tokens: Sequence[int], computed: int) -> List[int]:
        """Enter in the tree every full block of a sequence whose positions 0 .. computed - 1 are computed.

        A block whose parent already has a child with the same ids (another sequence computed the same
        prefix) is swapped, in `blocks`, for that child: the sequence goes on with the shared copy and its
        own is released, so the tree holds one block per prefix.

        Returns:
            the indices in `blocks` of the blocks entered now (not those swapped for a shared copy).
        """
        bs = self.block_size
        entered = []
        for i in range(min(computed // bs, len(blocks))):
            block = self.blocks[blocks[i]]
            if block.cached:
                continue
            parent = self.root if i == 0 else self.blocks[blocks[i - 1]]
            key = tuple(tokens[i * bs : (i + 1) * bs])
            existing = parent.children.get(key)
            if existing is not None:
                self.hold([existing.id])
                self.release([block.id])
                blocks[i] = existing.id
            else:
                self._enter(block, parent, key)
                entered.append(i)
        return entered

    def keep_partial(self, blocks: Sequence[int], tokens: Sequence[int], computed: int) -> None:
        """Before a sequence lets its blocks go: enter its last, partly computed block in the tree, so
        a later sequence that starts with the same tokens can copy them."""
        bs = self.block_size
        i = computed // bs
        if computed % bs == 0 or i >= len(blocks) or self.blocks[blocks[i]].cached:
            return
        parent = self.root if i == 0 else self.blocks[blocks[i - 1]]
        if i > 0 and not parent.cached:
            return
        key = tuple(tokens[i * bs : computed])
        if key not in parent.children:
            self._enter(self.blocks[blocks[i]], parent, key)

    def _enter(self, block: Block, parent: Block, key: Tuple[int, ...]) -> None:
        block.tokens, block.parent = key, parent
        parent.children[key] = block

    def _evict(self) -> Block:
        """Take back the least recently released cached block that no other cached block follows."""
        for i in self.evictable:
            block = self.blocks[i]
            if not block.children:
                break
        else:  # unreachable: a cached block nobody holds has only such blocks after it, and the last is a leaf
            raise AssertionError("no cached leaf block to take back")
        del self.evictable[block.id]
        del block.parent.children[block.tokens]
        block.parent, block.tokens = None, ()
        return block
