"""PrefixIndex: a token-granular radix index of cached sequences.

Each cached sequence is a :class:`PrefixEntry`: a non-empty run of token ids and an opaque
``value`` (the caller's checkpoint handle, never read by the index).  A new sequence reuses exactly
its longest cached prefix, at token granularity: :meth:`PrefixIndex.longest_match` finds an entry
sharing the longest common prefix with it, and that length, even where the match ends inside a run
that no other entry branches from.

The index is a compressed radix tree.  Every edge is labelled by a run of token ids, held in its own
int64 array; an entry sits at the node where its tokens end.  Matching walks one edge per node
level and compares each label against the query with one vectorized comparison, so a long shared
run costs one numpy call, never a Python loop over its tokens.  Every node keeps the most recently
used entry of its subtree, so the entry to return is known as soon as the walk stops.

Recency is ``(last_use, order)``: ``last_use`` is the caller's clock, given to
:meth:`PrefixIndex.insert` and :meth:`PrefixIndex.touch`; among equal ``last_use`` the later of
those calls counts as more recent.  Every tie (longest match, covering entry, eviction order) is
broken by this total order.

The index refuses redundant entries: a sequence that is already an entry, or a prefix of one, is
matched at least as well by that entry (:meth:`PrefixIndex.covering`), so inserting it raises.  The
converse, an entry that a new longer one makes redundant (:meth:`PrefixIndex.covered`), is left to
the caller to remove.

The index is plain Python and numpy, and not thread-safe; one host thread owns it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["PrefixEntry", "PrefixIndex"]

_INT64_MAX = np.iinfo(np.int64).max
_EMPTY = np.zeros(0, np.int64)
_EMPTY.flags.writeable = False


def _as_tokens(tokens, what: str = "tokens") -> np.ndarray:
    """``tokens`` as a 1-D int64 array (the input itself when it already is one; never written)."""
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return _EMPTY
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integer token ids, got dtype {arr.dtype}")
    if arr.dtype != np.int64:
        if arr.dtype == np.uint64 and int(arr.max()) > _INT64_MAX:
            raise ValueError(f"{what}: token id {int(arr.max())} does not fit in int64")
        arr = arr.astype(np.int64)
    return arr


def _owned(arr: np.ndarray) -> np.ndarray:
    """A read-only copy of ``arr`` that owns its memory."""
    out = np.array(arr, dtype=np.int64, copy=True)
    out.flags.writeable = False
    return out


def _clock(now, what: str = "now") -> int:
    if isinstance(now, bool) or not isinstance(now, (int, np.integer)):
        raise TypeError(f"{what}={now!r} must be an integer")
    return int(now)


class PrefixEntry:
    """One cached sequence of a :class:`PrefixIndex`.

    Attributes:
      tokens: the sequence, a read-only int64 array (a copy of what was inserted).
      value: the caller's opaque handle; the index never reads it.
      last_use: the clock of the latest :meth:`PrefixIndex.insert` or :meth:`PrefixIndex.touch`.
      pins: the number of current users; a pinned entry is never offered for eviction.
      length: ``len(tokens)``.

    Entries compare by identity.  ``tokens``, ``last_use`` and ``pins`` change only through the
    index's verbs.
    """

    __slots__ = ("_tokens", "value", "_last_use", "_order", "_pins", "_node")

    def __init__(self, tokens: np.ndarray, value, last_use: int, order: int, node: _Node):
        self._tokens = tokens
        self.value = value
        self._last_use = last_use
        self._order = order
        self._pins = 0
        self._node: _Node | None = node

    @property
    def tokens(self) -> np.ndarray:
        """The entry's token ids (read-only int64 array)."""
        return self._tokens

    @property
    def length(self) -> int:
        """The number of tokens."""
        return int(self._tokens.size)

    @property
    def last_use(self) -> int:
        """The clock of the latest insert or touch."""
        return self._last_use

    @property
    def pins(self) -> int:
        """The number of current users (pins minus unpins)."""
        return self._pins

    def __len__(self) -> int:
        return int(self._tokens.size)

    def __repr__(self) -> str:
        return (
            f"PrefixEntry(length={self.length}, last_use={self._last_use}, pins={self._pins}, "
            f"value={self.value!r})"
        )


def _newer(a: PrefixEntry | None, b: PrefixEntry | None) -> PrefixEntry | None:
    """The more recently used of two entries (``None`` is older than any entry)."""
    if a is None:
        return b
    if b is None:
        return a
    return a if (a._last_use, a._order) > (b._last_use, b._order) else b


class _Node:
    """A tree node: the edge from its parent, its children by first token, an entry ending here."""

    __slots__ = ("edge", "parent", "children", "entry", "best", "depth")

    def __init__(self, edge: np.ndarray, parent: _Node | None, depth: int):
        self.edge = edge  # tokens from the parent to here (empty only at the root)
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.entry: PrefixEntry | None = None
        self.best: PrefixEntry | None = None  # most recently used entry of the subtree
        self.depth = depth  # tokens from the root to here

    def recompute_best(self) -> None:
        best = self.entry
        for child in self.children.values():
            best = _newer(best, child.best)
        self.best = best


class PrefixIndex:
    """A compressed radix tree of token sequences, each ending at a :class:`PrefixEntry`.

    Invariants, at every public call boundary (:meth:`check` verifies them all):

    * every entry is reachable from the root by its tokens and sits at the node where they end;
      ``entry.length`` is that node's depth;
    * no entry's tokens are a prefix of (or equal to) another entry's tokens, except as a proper
      prefix that the caller has not removed yet (:meth:`covered`);
    * the root has an empty edge and no entry; every other node has a non-empty edge, is keyed in
      its parent by the edge's first token, and either holds an entry or has at least two children
      (the tree is compressed: no entry-less chain node, no entry-less leaf);
    * every node's ``best`` is the most recently used entry of its subtree;
    * ``len(index)`` is the number of entries, ``num_tokens`` the total length of all edges (the
      number of distinct non-empty prefixes of the entries' tokens); an empty index has an empty
      root and ``num_tokens == 0``;
    * ``pins >= 0`` for every entry.

    Verbs: :meth:`insert`, :meth:`remove`, :meth:`touch`, :meth:`pin` / :meth:`unpin`; queries:
    :meth:`longest_match`, :meth:`covering`, :meth:`covered`, :meth:`eviction_order`.
    """

    def __init__(self):
        self._root = _Node(_EMPTY, None, 0)
        self._entries: dict[PrefixEntry, None] = {}  # insertion order
        self._num_tokens = 0
        self._order = 0

    # -- counts -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """The number of entries."""
        return len(self._entries)

    def __iter__(self) -> Iterator[PrefixEntry]:
        """The entries, in insertion order."""
        return iter(list(self._entries))

    def __contains__(self, entry) -> bool:
        """Whether ``entry`` is an entry of this index."""
        return entry in self._entries

    @property
    def num_tokens(self) -> int:
        """Tokens held by the tree's edges (each distinct prefix of the entries counted once)."""
        return self._num_tokens

    # -- walking ------------------------------------------------------------------------------------
    def _walk(self, q: np.ndarray, passed: list | None = None) -> tuple[_Node, _Node | None, int]:
        """Follow ``q`` from the root as far as it matches.

        Returns ``(node, child, n)``: the match covers ``n`` tokens and ends at ``node`` when
        ``child`` is ``None``, else inside ``child``'s edge (after ``n - node.depth`` of its
        tokens).  Entries on fully matched nodes with depth below ``len(q)`` are appended to
        ``passed``.
        """
        node = self._root
        m = q.size
        pos = 0
        while pos < m:
            child = node.children.get(int(q[pos]))
            if child is None:
                break
            edge = child.edge
            k = min(edge.size, m - pos)
            if k > 1:  # the first token matched through the dict key
                diff = np.flatnonzero(edge[1:k] != q[pos + 1 : pos + k])
                if diff.size:
                    return node, child, pos + 1 + int(diff[0])
            if k < edge.size:
                return node, child, pos + k
            pos += k
            node = child
            if passed is not None and pos < m and node.entry is not None:
                passed.append(node.entry)
        return node, None, pos

    def _require_entry(self, entry) -> PrefixEntry:
        if not isinstance(entry, PrefixEntry) or entry not in self._entries:
            raise ValueError(f"{entry!r} is not an entry of this index")
        return entry

    # -- queries ------------------------------------------------------------------------------------
    def longest_match(self, tokens: Sequence[int] | np.ndarray, limit: int | None = None):
        """An entry sharing the longest common prefix with ``tokens[:limit]``, and that length.

        Returns ``(entry, n)``, or ``(None, 0)`` when no entry shares even the first token.  Among
        the entries that share ``n`` tokens, the most recently used is returned.  ``limit=None``
        matches all of ``tokens``.
        """
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0:
                raise ValueError(f"limit={limit!r} must be an integer >= 0")
            tokens = tokens[: int(limit)]
        q = _as_tokens(tokens)
        node, child, n = self._walk(q)
        if n == 0:
            return None, 0
        return (node if child is None else child).best, n

    def covering(self, tokens: Sequence[int] | np.ndarray) -> PrefixEntry | None:
        """The most recently used entry whose tokens start with ``tokens`` (equal included).

        ``None`` when there is none (empty ``tokens`` start every entry).  Such an entry matches every
        sequence that ``tokens`` would, at least as far, so :meth:`insert` refuses ``tokens``.
        """
        q = _as_tokens(tokens)
        node, child, n = self._walk(q)
        if n < q.size:
            return None
        return (node if child is None else child).best

    def covered(self, tokens: Sequence[int] | np.ndarray) -> list[PrefixEntry]:
        """The entries whose tokens are a proper prefix of ``tokens``, shortest first.

        An entry for ``tokens`` would match everything these match, at least as far.
        """
        q = _as_tokens(tokens)
        passed: list[PrefixEntry] = []
        self._walk(q, passed)
        return passed

    def eviction_order(self) -> list[PrefixEntry]:
        """The unpinned entries, least recently used first."""
        free = [e for e in self._entries if e._pins == 0]
        free.sort(key=lambda e: (e._last_use, e._order))
        return free

    # -- verbs --------------------------------------------------------------------------------------
    def _stamp(self) -> int:
        self._order += 1
        return self._order

    def insert(self, tokens: Sequence[int] | np.ndarray, value, *, now: int) -> PrefixEntry:
        """Add an entry for ``tokens`` (non-empty) carrying ``value``, used at ``now``; returns it.

        Raises ``ValueError`` when an entry already covers ``tokens`` (:meth:`covering`): the caller
        should use that entry instead.  Entries that ``tokens`` covers (:meth:`covered`) stay.
        """
        now = _clock(now)
        q = _as_tokens(tokens)
        if q.size == 0:
            raise ValueError("tokens must be non-empty")
        node, child, n = self._walk(q)
        if n == q.size:
            holder = (node if child is None else child).best
            raise ValueError(
                f"{q.size} tokens are already covered by {holder!r}; use that entry instead of inserting"
            )
        if child is not None:  # the match ends inside child's edge: split it there
            cut = n - node.depth
            mid = _Node(_owned(child.edge[:cut]), node, n)
            child.edge = _owned(child.edge[cut:])
            child.parent = mid
            mid.children[int(child.edge[0])] = child
            mid.best = child.best
            node.children[int(mid.edge[0])] = mid
            node = mid
        leaf = _Node(_owned(q[n:]), node, q.size)
        node.children[int(leaf.edge[0])] = leaf
        self._num_tokens += leaf.edge.size
        entry = PrefixEntry(_owned(q), value, now, self._stamp(), leaf)
        leaf.entry = entry
        leaf.best = entry
        self._entries[entry] = None
        self._raise_best(node, entry)
        return entry

    def _raise_best(self, node: _Node | None, entry: PrefixEntry) -> None:
        """Propagate ``entry``'s new recency from ``node`` (whose subtree holds it) to the root."""
        while node is not None:
            best = node.best
            if best is entry:
                node.recompute_best()  # its recency may have gone down
            elif _newer(best, entry) is entry:
                node.best = entry
            else:
                return  # unchanged here, hence unchanged above
            node = node.parent

    def touch(self, entry: PrefixEntry, now: int) -> None:
        """Record a use of ``entry`` at ``now`` (it becomes the most recent among equal clocks)."""
        now = _clock(now)
        self._require_entry(entry)
        entry._last_use = now
        entry._order = self._stamp()
        self._raise_best(entry._node, entry)

    def pin(self, entry: PrefixEntry) -> None:
        """Add a user of ``entry``; a pinned entry is never offered for eviction."""
        self._require_entry(entry)
        entry._pins += 1

    def unpin(self, entry: PrefixEntry) -> None:
        """Drop a user of ``entry``; ``ValueError`` when it has none."""
        self._require_entry(entry)
        if entry._pins == 0:
            raise ValueError(f"{entry!r} is not pinned")
        entry._pins -= 1

    def remove(self, entry: PrefixEntry) -> None:
        """Take ``entry`` out of the index, merging nodes so the tree stays compressed.

        Raises ``ValueError`` when ``entry`` is pinned (unpin it first) or not in this index.
        """
        self._require_entry(entry)
        if entry._pins:
            raise ValueError(f"{entry!r} is pinned by {entry._pins} user(s); unpin it before removing it")
        node = entry._node
        assert node is not None
        node.entry = None
        entry._node = None
        del self._entries[entry]
        parent = node.parent
        if not node.children:  # a leaf: drop it
            del parent.children[int(node.edge[0])]
            self._num_tokens -= node.edge.size
            start = parent
            if parent.entry is None and len(parent.children) == 1 and parent.parent is not None:
                start = parent.parent
                self._merge(parent)
        elif len(node.children) == 1:  # a chain node: fold it into its child
            start = parent
            self._merge(node)
        else:
            start = node
        while start is not None and start.best is entry:
            start.recompute_best()
            start = start.parent

    def _merge(self, node: _Node) -> None:
        """Fold an entry-less non-root ``node`` with one child into that child."""
        (child,) = node.children.values()
        child.edge = _owned(np.concatenate((node.edge, child.edge)))
        child.parent = node.parent
        node.parent.children[int(child.edge[0])] = child
        node.children.clear()
        node.parent = None

    # -- invariants ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``AssertionError`` on any broken invariant (see the class docstring)."""

        def require(cond, msg):
            if not cond:
                raise AssertionError(f"PrefixIndex: {msg}")

        root = self._root
        require(root.parent is None and root.edge.size == 0 and root.depth == 0, "malformed root")
        require(root.entry is None, "the root holds an entry")
        found: list[PrefixEntry] = []
        tokens = 0
        order: list[_Node] = []  # parents before children
        stack = [root]
        while stack:
            node = stack.pop()
            order.append(node)
            if node.entry is not None:
                found.append(node.entry)
            for key, child in node.children.items():
                require(child.parent is node, f"child {key} of a node at depth {node.depth} has another parent")
                e = child.edge
                require(isinstance(e, np.ndarray) and e.ndim == 1 and e.dtype == np.int64, "malformed edge")
                require(e.size > 0, f"empty edge below depth {node.depth}")
                require(int(e[0]) == key, f"child key {key} is not its edge's first token {int(e[0])}")
                require(child.depth == node.depth + e.size, f"depth {child.depth} of a child is inconsistent")
                require(
                    child.entry is not None or len(child.children) >= 2,
                    f"entry-less node at depth {child.depth} with {len(child.children)} child(ren)",
                )
                tokens += e.size
                stack.append(child)
        for node in reversed(order):  # children before parents
            best = node.entry
            for child in node.children.values():
                best = _newer(best, child.best)
            require(node.best is best, f"node at depth {node.depth} has a stale most recent entry")
        require(len(found) == len(self._entries), f"{len(found)} entries in the tree, {len(self._entries)} listed")
        require(set(found) == set(self._entries), "the tree's entries differ from the listed ones")
        require(tokens == self._num_tokens, f"edges hold {tokens} tokens, num_tokens says {self._num_tokens}")
        for entry in self._entries:
            require(entry._pins >= 0, f"{entry!r} has negative pins")
            t = entry._tokens
            require(t.ndim == 1 and t.size > 0 and not t.flags.writeable, f"{entry!r} has malformed tokens")
            node, child, n = self._walk(t)
            require(
                child is None and n == t.size and node.entry is entry and entry._node is node,
                f"{entry!r} is not reachable by its tokens",
            )
            require(node.depth == entry.length, f"{entry!r} sits at depth {node.depth}")
