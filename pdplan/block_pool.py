"""A node's KV blocks, counted the way engine/block_manager.py keeps them: free, cached (a full
prompt block nobody holds, kept for a later prefix hit and evicted least recently used first) and
in use (private to a sequence, or a hashed block shared by reference count).

    total == free + cached + in use          (check_integrity)
"""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, total: int, prefix_caching: bool = True):
        self.total = total
        self.prefix_caching = prefix_caching
        self.private = 0                                # in use, not hashed
        self.refs: dict[int, int] = {}                  # hash -> holders (> 0: in use)
        self.cached: OrderedDict[int, None] = OrderedDict()   # hashes held by no one, LRU first

    @property
    def free(self) -> int:
        return self.total - self.private - len(self.refs) - len(self.cached)

    @property
    def available(self) -> int:
        """Blocks an allocation can take: free plus evictable cached ones."""
        return self.total - self.private - len(self.refs)

    @property
    def used(self) -> int:
        return self.private + len(self.refs)

    def hits(self, hashes: tuple[int, ...]) -> int:
        """Leading blocks of `hashes` this pool holds (in use or cached)."""
        if not self.prefix_caching:
            return 0
        n = 0
        for h in hashes:
            if h not in self.refs and h not in self.cached:
                break
            n += 1
        return n

    def acquire(self, hashes: tuple[int, ...]) -> None:
        """Take a reference on each of `hashes` (all must be held: see hits())."""
        for h in hashes:
            if h in self.cached:
                del self.cached[h]
                self.refs[h] = 1
            else:
                self.refs[h] += 1

    def take(self, n: int) -> None:
        """n private blocks, evicting cached ones (oldest first) when nothing is free."""
        if n > self.available:
            raise RuntimeError(f"take({n}) with {self.available} available")
        for _ in range(n - self.free):
            self.cached.popitem(last=False)
        self.private += n

    def publish(self, h: int) -> bool:
        """A private block became a full, computed prompt block: it is now shared under `h`.
        False (it stays private) when another sequence published the same block first."""
        if not self.prefix_caching or h in self.refs or h in self.cached:
            return False
        self.private -= 1
        self.refs[h] = 1
        return True

    def release(self, hashes: list[int], private: int) -> None:
        for h in hashes:
            self.refs[h] -= 1
            if self.refs[h] == 0:
                del self.refs[h]
                self.cached[h] = None
        self.private -= private

    def check_integrity(self) -> None:
        assert self.free >= 0 and self.private >= 0, (self.free, self.private)
        assert all(r > 0 for r in self.refs.values())
        assert not set(self.refs) & set(self.cached)
