"""Paged KV cache bookkeeping: block tables, reference counts and the prefix cache. No torch.

A block holds ``block_size`` consecutive tokens of one sequence. A *full* block whose K/V
have been computed is registered in the prefix cache under the hash of (its parent block's
hash, its tokens), so identical prefixes map to the same chain of hashes. A cached block
whose reference count drops to zero is kept, evictable, in least-recently-used order until
a new allocation needs it.

KV cache groups (``windows``, ``pagoda.engine.kv_groups``): a model that mixes sliding-window
and global layers has one block table per group for each sequence (``seq.block_table`` for
group 0, ``seq.group_block_tables`` for the others), all as long as the sequence needs and
drawn from one pool. A window group releases the blocks no future query can see (every key
position before ``computed - window + 1``): their entries become ``NULL_BLOCK`` and they go
back to the pool (to the evictable LRU when cached). Group g > 0 caches its blocks under
(parent hash, tokens, g); a cached prefix is taken as far as every global group holds it and
every window group holds the window before its end.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator

from pagoda.engine.sequence import Sequence

NO_PARENT = 0
NULL_BLOCK = -1  # a released block table entry (outside its group's window)


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """128-bit BLAKE2b of (parent hash, block tokens). Not Python's ``hash()``: that one is
    64-bit, unkeyed and invertible for ints, so a client could craft a prompt whose chain
    hash collides with another user's prefix and be served (or read) someone else's KV."""
    h = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def root_hash(lora_int_id: int) -> int:
    """The parent of a sequence's first block: the LoRA adapter's id enters every chain (the same
    tokens under two adapters have different K/V, so they never share cached blocks)."""
    return NO_PARENT if lora_int_id == 0 else chain_hash(NO_PARENT, (-1, lora_int_id))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,)):
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows) or (None,)  # per KV cache group: None (global) or its window
        self.num_groups = len(self.windows)
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # (parent hash, tokens) -> block of group 0; (parent hash, tokens, g) -> block of group g
        self.cached: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}  # block -> its cache key
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

    def new_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks (all groups) an allocation covering ``num_tokens`` tokens of ``seq`` takes from
        the pool, before any window's blocks are released."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table)) * self.num_groups

    def tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's block table of each group (group 0 first)."""
        if self.num_groups == 1:
            return [seq.block_table]
        if len(seq.group_block_tables) != self.num_groups - 1:
            seq.group_block_tables = [[] for _ in range(self.num_groups - 1)]
        return [seq.block_table, *seq.group_block_tables]

    def held_blocks(self, seq: Sequence) -> int:
        """Blocks the sequence holds now, over every group (released window blocks excluded)."""
        return sum(b != NULL_BLOCK for table in self.tables(seq) for b in table)

    def _first_visible(self, g: int, position: int) -> int:
        """The first block index of group g a query at ``position`` (or later) can see."""
        window = self.windows[g]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    # ------------------------------------------------------------------ prefix cache
    def _block_keys(self, seq: Sequence, start: int, end: int) -> Iterator[tuple[tuple, int]]:
        """(cache key, hash) of full blocks ``start..end-1`` of ``seq``, one at a time (a lookup
        stops hashing at its first miss); blocks before ``start`` must already be hashed in
        ``seq.block_hashes``."""
        parent = seq.block_hashes[start - 1] if start > 0 else root_hash(seq.lora_int_id)
        bs = self.block_size
        for i in range(start, end):
            key = (parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if seq.mm_inputs is not None:  # the hashes of the images the block holds tokens of
                key = (parent, key[1] + seq.mm_inputs.block_extra(i * bs, (i + 1) * bs))
            parent = chain_hash(*key)
            yield key, parent

    @staticmethod
    def _group_key(key: tuple, g: int) -> tuple:
        return key if g == 0 else key + (g,)

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Give a new sequence the longest cached prefix of its tokens (at least one token is
        left to compute, so the model still produces logits for it)."""
        self.prefix_queries += seq.num_tokens
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:  # (its logprobs need every position)
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if self.num_groups == 1 and self.windows[0] is None:
            found = []
            for key, h in self._block_keys(seq, 0, max_blocks):
                block = self.cached.get(key)
                if block is None:
                    break
                found.append((h, [block]))
        else:
            found = self._cached_chain(seq, max_blocks)
        hit = self._usable_prefix([blocks for _, blocks in found])
        tables = self.tables(seq)
        for i in range(hit):
            h, blocks = found[i]
            for g, (table, block) in enumerate(zip(tables, blocks)):
                if i < self._first_visible(g, hit * self.block_size):
                    table.append(NULL_BLOCK)
                    continue
                if self.ref_counts[block] == 0:
                    self.evictable.pop(block, None)
                self.ref_counts[block] += 1
                table.append(block)
            seq.block_hashes.append(h)
        seq.num_computed_tokens = hit * self.block_size
        self.prefix_hits += seq.num_computed_tokens

    def _cached_chain(self, seq: Sequence, max_blocks: int) -> list[tuple[int, list[int | None]]]:
        """(hash, cached block of each group or None) along the sequence's chain, up to the first
        block a global group lacks (window groups may lack blocks that left every window)."""
        found = []
        for key, h in self._block_keys(seq, 0, max_blocks):
            blocks = [self.cached.get(self._group_key(key, g)) for g in range(self.num_groups)]
            if any(b is None and w is None for b, w in zip(blocks, self.windows)):
                break
            found.append((h, blocks))
        return found

    def _usable_prefix(self, found: list[list[int | None]]) -> int:
        """The most leading blocks usable: a window group needs the blocks its window sees at the end."""
        for hit in range(len(found), 0, -1):
            if all(found[i][g] is not None for g in range(self.num_groups)
                   for i in range(self._first_visible(g, hit * self.block_size), hit)):
                return hit
        return 0

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full <= len(seq.block_hashes):
            return
        start = len(seq.block_hashes)
        tables = self.tables(seq)
        for i, (key, h) in enumerate(self._block_keys(seq, start, full), start):
            seq.block_hashes.append(h)
            for g, table in enumerate(tables):
                block = table[i]
                group_key = self._group_key(key, g)
                if block != NULL_BLOCK and group_key not in self.cached and self.block_hash[block] is None:
                    self.cached[group_key] = block
                    self.key_of[block] = group_key
                    self.block_hash[block] = h

    # ------------------------------------------------------------------ allocation
    def _pop_free_block(self) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        block, _ = self.evictable.popitem(last=False)
        del self.cached[self.key_of.pop(block)]
        self.block_hash[block] = None
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_hash[block] is not None:
                self.evictable[block] = None
            else:
                self.free_ids.append(block)

    def release_out_of_window(self, seq: Sequence) -> int:
        """Give back the blocks of the window groups that no query from ``num_computed_tokens`` on
        can see; returns how many."""
        released = 0
        for g, table in enumerate(self.tables(seq)):
            if self.windows[g] is None:
                continue
            for i in range(min(self._first_visible(g, seq.num_computed_tokens), len(table)) - 1, -1, -1):
                block = table[i]
                if block == NULL_BLOCK:
                    break  # released earlier, with everything before it
                table[i] = NULL_BLOCK
                self._release(block)
                released += 1
        return released

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make the block tables cover ``num_computed_tokens + num_new_tokens`` tokens.

        For a sequence with no blocks yet, first reuse its cached prefix (which may raise
        ``num_computed_tokens``; the caller recomputes how many tokens remain). Window groups
        first give back the blocks that left their windows. Returns False, allocating nothing,
        when there are not enough free blocks.
        """
        fresh = not seq.block_table and seq.num_computed_tokens == 0
        if fresh:
            self._take_cached_prefix(seq)
            num_new_tokens = min(num_new_tokens, seq.num_tokens - seq.num_computed_tokens)
        elif self.num_groups > 1 or self.windows[0] is not None:
            self.release_out_of_window(seq)
        per_group = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if per_group <= 0:
            return True
        if per_group * self.num_groups > self.num_free_blocks:
            if fresh:
                self.prefix_hits -= seq.num_computed_tokens
                self.prefix_queries -= seq.num_tokens
                self.free(seq)
            return False
        for table in self.tables(seq):
            for _ in range(per_group):
                block = self._pop_free_block()
                self.ref_counts[block] = 1
                table.append(block)
        return True

    def trim_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the ones ``num_tokens`` tokens need (speculative decoding: the
        slots of rejected draft tokens). Such blocks hold no computed full block, so none is cached."""
        keep = self.blocks_needed(num_tokens)
        for table in self.tables(seq):
            while len(table) > keep:
                block = table.pop()
                if block != NULL_BLOCK:
                    self._release(block)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; cached ones become evictable, tail first."""
        for table in self.tables(seq):
            for block in reversed(table):
                if block != NULL_BLOCK:
                    self._release(block)
        seq.block_table = []
        if seq.group_block_tables:
            seq.group_block_tables = []
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
