"""Paged KV cache bookkeeping: block tables, reference counts and the prefix cache. No torch.

A block holds ``block_size`` consecutive tokens of one sequence. A *full* block whose K/V
have been computed is registered in the prefix cache under the hash of (its parent block's
hash, its tokens), so identical prefixes map to the same chain of hashes. A cached block
whose reference count drops to zero is kept, evictable, in least-recently-used order until
a new allocation needs it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator

from pagoda.sequence import Sequence

NO_PARENT = 0


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """128-bit BLAKE2b of (parent hash, block tokens). Not Python's ``hash()``: that one is
    64-bit, unkeyed and invertible for ints, so a client could craft a prompt whose chain
    hash collides with another user's prefix and be served (or read) someone else's KV."""
    h = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent hash, tokens) -> block
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its cache key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, still cached; LRU first
        self.prefix_hits = 0  # tokens served from the cache, since start
        self.prefix_queries = 0  # tokens looked up

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def _block_keys(self, seq: Sequence, start: int, end: int) -> Iterator[tuple[tuple, int]]:
        """(cache key, hash) of full blocks ``start..end-1`` of ``seq``, one at a time (a lookup
        stops hashing at its first miss); blocks before ``start`` must already be hashed in
        ``seq.block_hashes``."""
        parent = seq.block_hashes[start - 1] if start > 0 else NO_PARENT
        bs = self.block_size
        for i in range(start, end):
            key = (parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            parent = chain_hash(*key)
            yield key, parent

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Give a new sequence the longest cached prefix of its tokens (at least one token is
        left to compute, so the model still produces logits for it)."""
        self.prefix_queries += seq.num_tokens
        if not self.enable_prefix_caching:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for key, h in self._block_keys(seq, 0, max_blocks):
            block = self.cached.get(key)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                self.evictable.pop(block, None)
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.prefix_hits += seq.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full <= len(seq.block_hashes):
            return
        start = len(seq.block_hashes)
        for i, (key, h) in enumerate(self._block_keys(seq, start, full), start):
            block = seq.block_table[i]
            seq.block_hashes.append(h)
            if key not in self.cached and self.block_hash[block] is None:
                self.cached[key] = block
                self.key_of[block] = key
                self.block_hash[block] = h

    # ------------------------------------------------------------------ allocation
    def _pop_free_block(self) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        block, _ = self.evictable.popitem(last=False)
        del self.cached[self.key_of.pop(block)]
        self.block_hash[block] = None
        return block

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make the block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        For a sequence with no blocks yet, first reuse its cached prefix (which may raise
        ``num_computed_tokens``; the caller recomputes how many tokens remain). Returns
        False, changing nothing, when there are not enough free blocks.
        """
        fresh = not seq.block_table and seq.num_computed_tokens == 0
        if fresh:
            self._take_cached_prefix(seq)
            num_new_tokens = min(num_new_tokens, seq.num_tokens - seq.num_computed_tokens)
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            if fresh:
                self.prefix_hits -= seq.num_computed_tokens
                self.prefix_queries -= seq.num_tokens
                self.free(seq)
            return False
        for _ in range(need):
            block = self._pop_free_block()
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; cached ones become evictable, tail first."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free_ids.append(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: evictable ones become free, used ones keep working
        uncached (freed, not kept, when their sequences end)."""
        while self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self.free_ids.append(block)
        for block, key in list(self.key_of.items()):
            del self.cached[key]
            self.block_hash[block] = None
        self.key_of.clear()

    def check_invariants(self) -> None:
        """For tests: every block is exactly one of free, evictable or referenced."""
        free = set(self.free_ids)
        ev = set(self.evictable)
        assert not free & ev
        for b in range(self.num_blocks):
            if self.ref_counts[b] > 0:
                assert b not in free and b not in ev, b
            else:
                assert (b in free) != (b in ev), b
            if b in ev:
                assert self.block_hash[b] is not None, b
        assert len(free) == len(self.free_ids)
        assert all(self.cached[key] == b and self.block_hash[b] is not None for b, key in self.key_of.items())
        assert len(self.cached) == len(self.key_of)
