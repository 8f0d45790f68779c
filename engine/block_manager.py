"""The block manager: physical KV blocks, per-sequence block tables, reference counts,
copy-on-write and the hash-chained prefix cache.

Every physical block is in exactly one state:

    in use     ref_count > 0             held by one or more block tables or pins
    cached     ref_count == 0, hashed    in `_evictable`, reusable by a prefix hit until evicted
    free       ref_count == 0, unhashed  in `_free`

Allocation takes free blocks first (lowest position in `_free` first), then evicts cached blocks
least recently freed first. A sequence frees its blocks tail first, so when a cached prompt has
to give way, its tail blocks go before the shared head blocks other prompts are likely to reuse.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple, NewType

from pdwire.block_hash import BlockHash, chain_hashes
from engine.kv_events import KVEventLog
from engine.sequence import Sequence


PinHandle = NewType("PinHandle", int)   # one pin(): its blocks stay in use until unpin(handle)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None   # set once the block is full and computed
    token_ids: tuple[int, ...] = ()       # the tokens behind block_hash, re-checked on a hit


class BlockCopy(NamedTuple):
    src: int   # shared block being written
    dst: int   # the writer's private copy


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class NoFreeBlocks(RuntimeError):
    """Raised when an allocation needs more blocks than are free; callers check first."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # LRU first
        self._cached: dict[BlockHash, int] = {}
        self._pins: dict[PinHandle, tuple[int, ...]] = {}   # blocks held outside any block table
        self._next_pin = 0
        self.stats = PrefixCacheStats()
        self.events: KVEventLog | None = None   # a node sets it: what enters and leaves `_cached`

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], hashes: list[BlockHash] | None = None) -> list[int]:
        """Block ids caching the longest run of leading full blocks of `token_ids`. Read-only."""
        if not self.enable_prefix_caching:
            return []
        hashes = hashes if hashes is not None else chain_hashes(token_ids, self.block_size)
        hits = []
        for i, h in enumerate(hashes):
            block_id = self._cached.get(h)
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def _prompt_hits(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching or not seq.reuses_cache:
            return []
        seq.block_hashes = chain_hashes(seq.token_ids, self.block_size, seq.block_hashes)
        # At least one token is always computed, so the sequence has logits to sample from.
        usable = (len(seq) - 1) // self.block_size
        return self.match_prefix(seq.token_ids, seq.block_hashes[:usable])

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, reserve_tokens: int = 0) -> bool:
        """Whether `allocate(seq)` would succeed with room for `reserve_tokens` more tokens."""
        return self._blocks_to_allocate(seq, self._prompt_hits(seq), reserve_tokens) <= self.num_free_blocks

    def _blocks_to_allocate(self, seq: Sequence, hits: list[int], reserve_tokens: int = 0) -> int:
        idle_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)   # leave the free pool
        return self.blocks_for(len(seq) + reserve_tokens) - len(hits) + idle_hits

    def allocate(self, seq: Sequence) -> int:
        """Give a block-less sequence blocks for all its tokens, reusing cached prefix blocks.
        Sets `seq.num_computed_tokens` to the tokens found cached and returns that count."""
        assert not seq.block_table, "allocate() takes a sequence without blocks"
        hits = self._prompt_hits(seq)
        if self._blocks_to_allocate(seq, hits) > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq.seq_id} needs more blocks than are free")
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = list(hits)
        while len(seq.block_table) < self.blocks_for(len(seq)):
            seq.block_table.append(self._take())
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        self.stats.queried_tokens += len(seq)
        self.stats.hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_to_append(seq) <= self.num_free_blocks

    def append_slots(self, seq: Sequence) -> list[BlockCopy]:
        """Make room for every token of `seq` and make the blocks about to be written private.
        Returns the copy-on-write pairs the caller must copy before the step runs."""
        if self.blocks_to_append(seq) > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq.seq_id} needs more blocks than are free")
        copies = []
        for i in range(self._first_written(seq), len(seq.block_table)):
            old = seq.block_table[i]
            if self.blocks[old].ref_count > 1:
                new = self._take()
                self._unref(old)
                seq.block_table[i] = new
                copies.append(BlockCopy(old, new))
        while len(seq.block_table) < self.blocks_for(len(seq)):
            seq.block_table.append(self._take())
        return copies

    def blocks_to_append(self, seq: Sequence) -> int:
        """Blocks `append_slots(seq)` would take: new ones plus private copies of shared ones."""
        shared = sum(1 for b in seq.block_table[self._first_written(seq):] if self.blocks[b].ref_count > 1)
        return max(0, self.blocks_for(len(seq)) - len(seq.block_table)) + shared

    def blocks_to_append_all(self, seqs: list[Sequence]) -> int:
        """Blocks `append_slots` takes for each of `seqs` in turn. A shared block about to be
        written costs a copy per holder among them, except that the last holder of all writes it
        in place: n completions sharing a partly filled block need n - 1 copies, not n."""
        new, holders = 0, Counter()
        for seq in seqs:
            new += max(0, self.blocks_for(len(seq)) - len(seq.block_table))
            holders.update(b for b in seq.block_table[self._first_written(seq):] if self.blocks[b].ref_count > 1)
        return new + sum(min(k, self.blocks[b].ref_count - 1) for b, k in holders.items())

    def blocks_to_allocate_all(self, seqs: list[Sequence], reserve_blocks: int = 0) -> int:
        """Blocks `allocate_group(seqs)` takes from the free pool, plus `reserve_blocks`."""
        lead = seqs[0]
        new = reserve_blocks + self._blocks_to_allocate(lead, self._prompt_hits(lead))
        for seq in seqs[1:]:
            new += self.blocks_for(len(seq)) - self._shareable(lead, seq)
        return new

    def allocate_group(self, seqs: list[Sequence]) -> None:
        """Blocks for block-less sequences of one group (n completions recomputed after a
        preemption): the first is allocated as `allocate` does; each other one shares the first
        one's leading full blocks that hold the same tokens, and waits for it to compute them
        (`Sequence.waits_for`), so a shared prompt is held and computed once."""
        lead = seqs[0]
        self.allocate(lead)
        for seq in seqs[1:]:
            assert not seq.block_table, "allocate_group() takes sequences without blocks"
            k = self._shareable(lead, seq)
            for block_id in lead.block_table[:k]:
                self._ref(block_id)
            seq.block_table = lead.block_table[:k]
            while len(seq.block_table) < self.blocks_for(len(seq)):
                seq.block_table.append(self._take())
            seq.num_computed_tokens = k * self.block_size
            lead.writes_shared = max(lead.writes_shared, k)
            if k * self.block_size > lead.num_computed_tokens:
                seq.waits_for = lead

    def _first_written(self, seq: Sequence) -> int:
        """The first block a step may write into: the one holding its first uncomputed token, or
        past the blocks it computes in place for sequences sharing them."""
        return max(seq.num_computed_tokens // self.block_size, seq.writes_shared)

    def _shareable(self, lead: Sequence, seq: Sequence) -> int:
        """Leading full blocks of `seq` with the same tokens as `lead`'s, leaving `seq` at least
        one token to compute (its logits)."""
        bs, k = self.block_size, 0
        limit = min(len(lead) // bs, (len(seq) - 1) // bs)
        while k < limit and lead.token_ids[k * bs:(k + 1) * bs] == seq.token_ids[k * bs:(k + 1) * bs]:
            k += 1
        return k

    def commit_computed(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        seq.block_hashes = chain_hashes(seq.token_ids[: full * self.block_size], self.block_size,
                                        seq.block_hashes[:full])
        for i in range(seq.num_registered_blocks, full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                block.token_ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                self._cached[h] = block.block_id
                if self.events is not None:
                    self.events.stored(h)
        seq.num_registered_blocks = full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (reference counts go up by one)."""
        for block_id in parent.block_table:
            self._ref(block_id)
        child.block_table = list(parent.block_table)

    # -- pins -------------------------------------------------------------------------------
    def pin(self, block_ids: list[int]) -> PinHandle:
        """One more reference to each block until `unpin(handle)`: a pinned block is never freed,
        evicted or rewritten (a zero-copy send is still reading it). Blocks must be in use."""
        for block_id in block_ids:
            self._ref(block_id)
        handle = PinHandle(self._next_pin)
        self._next_pin += 1
        self._pins[handle] = tuple(block_ids)
        return handle

    def unpin(self, handle: PinHandle) -> None:
        """Drop the pin's references, tail block first (as `free` does). KeyError if the handle is
        unknown or already unpinned."""
        for block_id in reversed(self._pins.pop(handle)):
            self._unref(block_id)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache now (a KV-event snapshot)."""
        return list(self._cached)

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail block first. Safe to call twice."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_registered_blocks = seq.writes_shared = 0
        seq.waits_for = None

    def take_block(self) -> int:
        """One block, referenced once, for a caller that builds a table itself (swap)."""
        return self._take()

    def ref_block(self, block_id: int) -> None:
        self._ref(block_id)

    # -- internals --------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._evict(self.blocks[block_id])
        else:
            raise NoFreeBlocks("no free KV blocks")
        self.blocks[block_id].ref_count = 1
        return block_id

    def _evict(self, block: Block) -> None:
        del self._cached[block.block_hash]
        if self.events is not None:
            self.events.removed(block.block_hash)
        block.block_hash, block.token_ids = None, ()

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    # -- checks and figures -----------------------------------------------------------------
    def check_integrity(self, seqs: list[Sequence] | None = None) -> None:
        """Check free + cached + in use == total, and (given every live sequence) that each
        reference count equals the number of block tables and pins holding that block. Raises
        IntegrityError; plain ifs, not asserts, so the check also runs under `python -O`."""
        free, cached = set(self._free), set(self._evictable)
        in_use = {b.block_id for b in self.blocks if b.ref_count > 0}
        _require(len(free) == len(self._free), "a block is twice in the free queue")
        _require(not (free & cached) and not (free & in_use) and not (cached & in_use), "block in two states")
        _require(len(free) + len(cached) + len(in_use) == self.num_blocks, "a block leaked")
        _require(all(self.blocks[b].block_hash is None for b in free), "a free block is still hashed")
        _require(all(self.blocks[b].block_hash is not None for b in cached), "an unhashed block is cached")
        _require(all(self.blocks[b].block_hash == h for h, b in self._cached.items()), "stale cache entry")
        if seqs is not None:
            refs = [0] * self.num_blocks
            for table in [s.block_table for s in seqs] + list(self._pins.values()):
                for block_id in table:
                    refs[block_id] += 1
            _require(refs == [b.ref_count for b in self.blocks], "reference counts disagree with tables")

    def wasted_slots(self, seqs: list[Sequence]) -> int:
        """Allocated token slots not holding a token (internal fragmentation), over `seqs`."""
        return sum(len(s.block_table) * self.block_size - len(s) for s in seqs if s.block_table)


class IntegrityError(AssertionError):
    """Block accounting broke. An AssertionError, so tests and callers that catch one still do."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise IntegrityError(what)
