"""Radix prefix cache: requests with a common token prefix share its KV slots.

Owns a tree whose edges are token sequences and whose nodes hold the slots of those
tokens. Invariants:
  * a node's `slots` has exactly `len(key)` entries, in order;
  * `lock_ref > 0` on a node means some running request uses it (and so every ancestor
    is locked too); only unlocked leaves are evicted, least recently used first;
  * every slot in the tree is owned by the tree: the allocator gets it back only through
    `evict` or `reset`.
It knows nothing about requests or scheduling; the scheduler decides what to insert.
`NoPrefixCache` implements the same interface for `--disable-radix-cache`.
"""
from __future__ import annotations

import heapq
import itertools

import torch

from specserve.cache.kv_pool import SlotAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)


# Recency is a logical clock, not the wall clock: eviction order then depends only on the
# sequence of operations, the same on every tensor-parallel rank.
_TICKS = itertools.count()


class Node:
    _ids = itertools.count()

    def __init__(self, key: list[int], slots: torch.Tensor, parent: Node | None) -> None:
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = next(_TICKS)
        self.id = next(Node._ids)

    def __lt__(self, other: Node) -> bool:  # heap order for eviction
        return self.last_access < other.last_access


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    enabled = True

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self.reset()

    def reset(self) -> None:
        """Drop the whole tree; the caller has already released every lock."""
        self.root = Node([], _EMPTY, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # -- queries ---------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, Node]:
        """Longest cached prefix of `key`: (its slots, the node where it ends)."""
        node, parts, pos = self.root, [], 0
        now = next(_TICKS)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.slots)
            node, pos = child, pos + n
        return (torch.cat(parts) if parts else _EMPTY), node

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # -- updates ---------------------------------------------------------------
    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        """Insert key -> slots; return how many leading tokens were already cached.

        The caller keeps ownership of slots[:returned] (duplicates of cached ones it must
        free) and hands the rest to the tree.
        """
        assert len(key) == slots.numel()
        node, pos = self.root, 0
        now = next(_TICKS)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                new = Node(key[pos:], slots[pos:].clone(), node)
                node.children[key[pos]] = new
                self._evictable += len(new.key)
                return pos
            n = _common_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    def _split(self, child: Node, n: int) -> Node:
        """Split `child` after n tokens; return the new upper node (same lock count)."""
        parent = child.parent
        assert parent is not None  # the root, the only parentless node, is never split
        upper = Node(child.key[:n], child.slots[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[upper.key[0]] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        upper.children[child.key[0]] = child
        return upper

    def lock(self, node: Node | None) -> None:
        """A running request starts using the path root..node (None: the caller holds no
        node, as NoPrefixCache hands out)."""
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None  # below the root every node has a parent
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            assert node.parent is not None  # below the root every node has a parent
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves, LRU first; return freed."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.slots)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def flush(self) -> bool:
        """Free every unlocked node (POST /flush_cache). False if some are locked."""
        self.evict(self._evictable)
        return self._protected == 0

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                yield node


class NoPrefixCache:
    """The `--disable-radix-cache` stand-in: nothing is shared, nothing is kept."""

    enabled = False

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self.root = None

    def reset(self) -> None:
        pass

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, Node | None]:
        return _EMPTY, None

    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        return len(key)  # "all already cached": the caller frees every slot itself

    def lock(self, node: Node | None) -> None:
        pass

    def unlock(self, node: Node | None) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def flush(self) -> bool:
        return True

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0
