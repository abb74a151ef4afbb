"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-sequence block tables and
automatic prefix caching.

Prefix caching: a full block whose keys and values are computed is content-addressed by
hash(parent block's hash, its token ids); the first block's parent is the sequence's cache_key
(b"" for the base model, a p-tuning task's name and table digest otherwise: virtual token ids are
the same for every task, their keys and values are not). A new sequence takes every cached block
of its longest cached prefix (reference-counted: several sequences read one block), except that
its last token is always computed (the step needs its logits). Blocks are shared only once full
and computed, and a sequence only ever writes past its last full block, so a shared block never
changes. When no sequence holds a cached block any more it stays cached, counts as free, and is
evicted least recently released first only when no empty block is left; a finished sequence's
blocks are released tail first, so its deepest blocks (useless once their parent is gone) go
before its first ones.

Placement keeps each sequence's blocks contiguous whenever the pool allows, because the CPU
attention backend then reads a sequence's keys and values as one slice of the cache, in place,
instead of gathering them (on 2 cores the gather cost 10x the attention itself):

- a sequence's first new block opens a *reservation*: a run of empty blocks sized for its whole
  expected length (prompt + max_tokens, capped by the context window), taken first-fit among
  the unreserved empty runs, else the largest one;
- each later block extends the sequence in place (the next block id) when that block is empty
  and not reserved by another sequence;
- otherwise a new reservation starts elsewhere (the sequence becomes two runs). When no empty run
  is long enough, and cached blocks that no sequence holds are, the reservation is the least
  recently released cached block with its unheld neighbours (before it first: a finished
  sequence is released tail first, so they are its earlier blocks, the next to go anyway), as
  one run; a cached block in it stays cached (a hit can still take it) until the sequence
  takes it. Taking the least recently released block one at a time instead split every
  sequence of a server whose cache had filled into one run per block (each run a separate read
  in attention: ~10 % slower decode attention, and a copy per chunk in prefill) even when
  nothing hits. When no unreserved unheld block is left, blocks reserved by others are taken
  (reservations are hints: every block that no sequence holds counts in `num_free`), and only
  then cached blocks are evicted one by one.
- a lazily mapped pool (a CPU cache whose pages the kernel maps on first write: `mapped` below the
  pool's size) prefers mapped memory: a reservation whose blocks needed now would reach past the
  mapped blocks takes, where one is long enough, the run around one of the least recently
  released cached blocks below them instead (evicting cold prefix-cache content rather than
  faulting fresh pages in the middle of a burst: on a 2-core EPYC VM mapping cost 1.8-10.4 s a
  GiB, and a fresh server's first 64-stream burst ran at 15-20 % system time). The idle engine
  maps more ahead (engines/core/async_engine.py), so the cache still grows between bursts.

Block tables stay correct whatever the placement; contiguity only makes attention cheaper.
Pure Python (no torch): the tuner's simulator runs it too.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice

from engines.core.sequence import Sequence

_ALLOCATED, _FREE, _RESERVED, _CACHED = 0, 1, 2, 3  # _CACHED: no holder, content kept for hits
_FREE_RUN = re.compile(rb"\x01+")
LRU_CANDIDATES = 8
"""Least recently released cached blocks a new run is sought around (the first long enough wins)."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_hash(parent: bytes, token_ids: Iterable[int]) -> bytes:
    """The 32-byte key of a full block: sha256 of its parent's key and its token ids (int64).
    A cryptographic hash because a prompt could be built to collide with another user's blocks
    under Python's hash() (vLLM moved to sha256 for that reason)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def cache_key(*parts: str | bytes) -> bytes:
    """A sequence's cache_key from what besides its token ids changes its keys and values (a
    p-tuning task's name and table digest); no parts: b"", the base model's."""
    if not parts:
        return b""
    h = hashlib.sha256(b"shardserve-prefix")
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little") + b)  # length-prefixed: ("ab", "c") != ("a", "bc")
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self._state = bytearray([_FREE]) * num_blocks
        self._ref: dict[int, int] = {}  # held block -> sequences holding it (sized by use, not by the pool)
        self._owner: dict[int, int] = {}  # reserved block -> seq_id
        self._reservations: dict[int, list[int]] = {}  # seq_id -> its reserved (not yet taken) blocks
        self._num_free = num_blocks
        self.high_water = 0
        self.mapped = num_blocks
        """Blocks [0, max(mapped, high_water)) are known to have their pages mapped: what KVCache.prefault mapped so
        far (a user-sized cache all of it, LLMEngine._map_cache; else the serving engine's idle loop, ahead). The
        pool's size: every block alike (plain first fit)."""
        """Blocks [0, high_water) have been taken at least once (first fit fills the pool from the bottom): the
        idle engine keeps the KV cache's pages mapped some way above it (engines/core/async_engine.py)."""
        self._by_hash: dict[bytes, int] = {}  # content key -> cached block
        self._hash_of: dict[int, bytes] = {}  # cached block -> content key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld; least recently released first
        self.query_tokens = 0
        """Tokens looked up in the prefix cache at admission (prompt, plus the output so far of a
        resumed preempted sequence)."""
        self.hit_tokens = 0
        """Of those, tokens whose keys and values came from the cache."""

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds: empty, reserved, or cached and evictable."""
        return self._num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose content is in the prefix cache (held or not)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        return 1.0 - self._num_free / self.num_blocks

    def needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must still get so that `num_tokens` tokens fit."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_ids))

    def _expected_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks the sequence will hold at its longest, as far as its request says."""
        total = seq.prompt_len + (seq.params.max_tokens if seq.params.max_tokens is not None
                                  else (self.max_model_len or num_tokens))
        if self.max_model_len:
            total = min(total, self.max_model_len)
        return max(blocks_for(max(total, num_tokens), self.block_size), 1)

    def growth(self, seq: Sequence) -> int:
        """Blocks `seq` will still take before it ends, as far as its request says."""
        return max(0, self._expected_blocks(seq, seq.num_tokens) - len(seq.block_ids))

    # prefix caching
    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """seq.block_hashes extended to (at least) its first n full blocks."""
        hs, bs = seq.block_hashes, self.block_size
        for i in range(len(hs), n):
            hs.append(block_hash(hs[-1] if hs else seq.cache_key, seq.token_ids[i * bs:(i + 1) * bs]))
        return hs

    def match(self, seq: Sequence) -> list[int]:
        """Cached blocks of the longest cached prefix of a sequence that holds no blocks: full
        blocks only, never the last token (it must run so that the step has its logits), nor a
        prompt position whose logprob is still to be returned (its hidden row is needed)."""
        if not self.enable_prefix_caching or seq.block_ids:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        if seq.params.prompt_logprobs is not None and seq.index == 0:
            limit = min(limit, seq.prompt_logprobs_done // self.block_size)
        hits = []
        for h in self._hashes(seq, limit)[:limit]:
            b = self._by_hash.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def claim_cost(self, hits: list[int]) -> int:
        """Free blocks that taking `hits` uses up (cached blocks no sequence holds now)."""
        return sum(1 for b in hits if b not in self._ref)

    def share(self, seq: Sequence, hits: list[int]) -> None:
        """Give a sequence that holds no blocks the cached blocks `hits` (from match) as its first
        blocks, and count the lookup in the hit rate; the caller sets num_computed."""
        assert not seq.block_ids, "share() starts a block table"
        for b in hits:
            held = self._ref.get(b, 0)
            if not held:
                del self._evictable[b]
                self._owner.pop(b, None)  # a hit outranks another sequence's reservation of it
                self._state[b] = _ALLOCATED
                self._num_free -= 1
            self._ref[b] = held + 1
        seq.block_ids = list(hits)
        seq.num_cached_blocks = len(hits)
        if self.enable_prefix_caching:
            self.query_tokens += seq.num_tokens
            self.hit_tokens += len(hits) * self.block_size

    def cache_computed(self, seq: Sequence) -> None:
        """Register the sequence's full blocks whose keys and values are now computed (call after
        seq.num_computed moved), so that later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        n = min(seq.num_computed // self.block_size, len(seq.block_ids))
        if n <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, n)
        for i in range(seq.num_cached_blocks, n):
            b, h = seq.block_ids[i], hashes[i]
            if h not in self._by_hash:  # else an equal block is cached already: this one stays private
                self._by_hash[h] = b
                self._hash_of[b] = h
        seq.num_cached_blocks = n

    def reset_prefix_cache(self) -> int:
        """Forget every cached block's content (vLLM's reset_prefix_cache): unheld ones become empty,
        held ones stay with their sequences but are no longer shared. Returns the blocks forgotten."""
        n = len(self._hash_of)
        for b in list(self._evictable):
            self._evict(b)
            self._state[b] = _FREE
        self._by_hash.clear()
        self._hash_of.clear()
        return n

    def _evict(self, b: int) -> None:
        del self._evictable[b]
        del self._by_hash[self._hash_of.pop(b)]

    # allocation
    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        n = self.needed(seq, num_tokens)
        if n > self._num_free:
            raise RuntimeError(f"KV cache out of blocks: need {n}, {self._num_free} free")
        ids = seq.block_ids
        for k in range(n):
            nxt = ids[-1] + 1 if ids else -1
            if not (0 <= nxt < self.num_blocks and self._takeable(nxt, seq.seq_id)):
                nxt = self._reserve(seq, self._expected_blocks(seq, num_tokens) - len(ids), n - k)
            self._take(nxt)
            ids.append(nxt)

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_ids):  # tail first: the deepest blocks are evicted first
            held = self._ref.pop(b) - 1
            if held:
                self._ref[b] = held
            else:
                self._num_free += 1
                if b in self._hash_of:
                    self._state[b] = _CACHED
                    self._evictable[b] = None
                else:
                    self._state[b] = _FREE
        seq.block_ids = []
        seq.num_cached_blocks = 0
        for b in self._reservations.pop(seq.seq_id, ()):
            if self._owner.get(b) == seq.seq_id:
                del self._owner[b]
                if self._state[b] == _RESERVED:
                    self._state[b] = _FREE

    # placement
    def _takeable(self, b: int, seq_id: int) -> bool:
        s = self._state[b]
        return s == _FREE or (s in (_RESERVED, _CACHED) and self._owner.get(b) == seq_id)

    def _take(self, b: int) -> None:
        s = self._state[b]
        self._owner.pop(b, None)  # a reserved block, empty or still cached
        if s == _CACHED:
            self._evict(b)
        self._state[b] = _ALLOCATED
        self._ref[b] = 1
        self._num_free -= 1
        if b >= self.high_water:
            self.high_water = b + 1

    def _reserve(self, seq: Sequence, want: int, now: int = 1) -> int:
        """Start a new run for `seq`: reserve up to `want` empty blocks and return the first; with
        none left, a block reserved by another sequence, else the least recently released cached one.
        `now`: the blocks the caller takes at once (in a lazily mapped pool they should be mapped)."""
        want, now = max(want, 1), max(min(now, want), 1)
        start = end = -1
        m = re.search(rb"\x01{%d,}" % want, self._state)  # first fit
        bound = max(self.mapped, self.high_water)
        if self._evictable and bound < self.num_blocks and (m is None or m.start() + now > bound):
            lo, hi = self._lru_run(want, bound, now)  # cold cached blocks' mapped pages before fresh ones
            if hi - lo >= now:
                start, end = lo, hi
        if start < 0 and m:
            start, end = m.start(), m.start() + want
        elif start < 0:
            best = max(_FREE_RUN.finditer(self._state), key=lambda r: r.end() - r.start(), default=None)
            if best is not None:
                start, end = best.start(), best.end()
            if self._evictable and end - start < want:
                lo, hi = self._lru_run(want, self.num_blocks, want)
                if hi - lo > end - start:
                    start, end = lo, hi
        if start < 0:
            reserved = self._state.find(_RESERVED)
            return reserved if reserved >= 0 else next(iter(self._evictable))
        mine = self._reservations.setdefault(seq.seq_id, [])
        for b in range(start, end):
            if self._state[b] == _FREE:
                self._state[b] = _RESERVED  # a cached block stays _CACHED (and evictable) until taken
            self._owner[b] = seq.seq_id
            mine.append(b)
        return start

    def _lru_run(self, want: int, bound: int, enough: int) -> tuple[int, int]:
        """[lo, hi): up to `want` unheld, unreserved blocks (empty or cached) below `bound` around one of the
        least recently released cached blocks that no other sequence reserved, its predecessors first: the
        first such run of at least `enough` blocks among the LRU_CANDIDATES oldest, else the longest; (0, 0):
        none."""
        st, owner = self._state, self._owner
        best = (0, 0)
        for b in islice((b for b in self._evictable if b not in owner and b < bound), LRU_CANDIDATES):
            lo, hi = b, b + 1
            while lo > 0 and hi - lo < want and st[lo - 1] in (_FREE, _CACHED) and lo - 1 not in owner:
                lo -= 1
            while hi < bound and hi - lo < want and st[hi] in (_FREE, _CACHED) and hi not in owner:
                hi += 1
            if hi - lo >= enough:
                return lo, hi
            if hi - lo > best[1] - best[0]:
                best = (lo, hi)
        return best
