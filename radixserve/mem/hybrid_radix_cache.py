"""HybridRadixCache: the radix cache of hybrid models (linear attention beside full attention).

A cached prefix of a hybrid model needs two things: the KV of its full-attention layers, which
the tree holds per token as for any model, and the recurrent states of its linear-attention
layers after its last token, which exist only at the points where a request stopped. So a node
may carry `state`, a snapshot row of the RecurrentStatePool holding a copy of those states, and
a prefix is reusable only up to the deepest node of the match that carries one (the root stands
for the zero states of the empty prefix).

A prompt sent again matches all but its last token (the scheduler recomputes that one for its
logits), where no snapshot would otherwise be: so the pass that ends a prompt also writes the
states before its last token into a row reserved for it (`reserve_prompt_snapshots`, at batch
build; layers/gated_delta_net.py writes it), kept at that prefix when the request is next
cached (n > 1, a regenerated answer, the same prompt from many clients).

Prompts that share an opening (a system prompt) part from each other where no request stopped.
So a pass also writes a prompt's states at its branch point, the end of the longest cached
sequence it shares when that reaches at least BRANCH_MIN_TOKENS past its reused prefix
(`_branch_point`, found at batch build): the second prompt with a new system prompt computes it
in full, and every later one reuses it. The pass runs the prompt in segments cut there
(layers/gated_delta_net.py).

Other snapshots are taken where the scheduler caches a request (`cache_finished_req`: finished,
retracted, or requeued; `cache_unfinished_req`: after a prompt or a prompt's chunk). The copy is
queued on the device behind every pass launched so far, and the scheduler counts such passes'
tokens in the `token_ids` it hands over (a request's `kv_len`), so the copy is the state after
exactly those tokens, even while an overlapped step is still in flight. A request admitted on a
prefix gets the prefix's states copied into its own row (`restore_states`) before its first pass;
its lock on the node keeps the snapshot from being reused meanwhile.

Snapshot rows are few (as many as request rows). When none is free, the least recently used
snapshot no request is locked on is dropped (its KV stays cached, reusable up to a shallower
snapshot); a node evicted from the tree frees its snapshot.

Prompts that arrive together part from each other before any is cached: a waiting prompt that
shares at least BRANCH_MIN_TOKENS past its reused prefix with one admitted to the same prefill
batch waits for the next batch (`waits_behind`, from the scheduler's in-batch prefix index),
and the admitted one's pass keeps its states where the two part.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from radixserve.mem.base_cache import MatchResult
from radixserve.mem.kv_pool import KVPool
from radixserve.mem.radix_cache import (RadixCache, TreeNode, _as_node, _common_prefix_len,
                                        _require)
from radixserve.mem.recurrent_state_pool import RecurrentStatePool
from radixserve.mem.req_to_token_pool import ReqToTokenPool

if TYPE_CHECKING:
    from radixserve.core.req import Req


# a prompt that parts from the cached sequences this many tokens or more past its reused prefix
# keeps its states at the branch point (fewer: a chat template's opening, not worth a row)
BRANCH_MIN_TOKENS = 64


class HybridRadixCache(RadixCache):

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: KVPool,
                 state_pool: RecurrentStatePool) -> None:
        if not state_pool.snapshots:
            raise ValueError("a hybrid radix cache needs snapshot rows in the state pool")
        self.state_pool = state_pool
        super().__init__(req_to_token_pool, token_to_kv_pool)

    def reset(self) -> None:
        super().reset()
        self._free_snapshots = list(reversed(self.state_pool.snapshot_rows()))
        self._snapshot_nodes: set[TreeNode] = set()
        # (last access, node id, push count, node) of snapshot nodes, lazily updated
        # (_take_snapshot_row)
        self._snapshot_heap: list[tuple[int, int, int, TreeNode]] = []
        self._reserved: set[int] = set()  # rows a pass is writing, not yet at a node
        # prompt lengths an admitted request's pass is to keep states at, by rid: where a
        # request waiting behind it parts from it (`waits_behind`)
        self._wanted: dict[str, set[int]] = {}

    # ---- lookups ----
    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest cached prefix of `key` that ends where a snapshot is kept."""
        indices, handle = self._walk(key)
        node, length = _as_node(handle), len(indices)
        while node is not None and node is not self.root and node.state is None:
            length -= len(node.key)
            node = node.parent
        return MatchResult(indices=indices[:length], handle=node)

    def restore_states(self, rows: list[int], handles: list[object]) -> None:
        sources, targets = [], []
        for row, handle in zip(rows, handles):
            node = _as_node(handle)
            if node is not None and node is not self.root:
                _require(node.state is not None, f"{node!r} was matched without a snapshot")
                sources.append(node.state)
                targets.append(row)
        self.state_pool.copy_rows(sources, targets)  # type: ignore[arg-type]

    def waits_behind(self, req: "Req", admitted: list["Req"]) -> bool:
        """Wait when `req` shares at least BRANCH_MIN_TOKENS past its reused prefix with one
        of `admitted` (the one sharing most); that one's pass then keeps its states where
        they part (a row is reserved for it at batch build), so `req` reuses the shared part
        next batch. The point stops short of `req`'s last token, which `req` recomputes for
        its logits (so its match ends before it)."""
        best, shared = None, 0
        for other in admitted:
            # whole, if chunked; keyed (a LoRA adapter's requests share with their own only)
            length = _common_prefix_len(other.cache_key(other.all_ids()),
                                        req.cache_key(req.fill_ids), 0)
            if length > shared:
                best, shared = other, length
        shared = min(shared, len(req.fill_ids) - 1)
        if best is None or shared - len(req.prefix_indices) < BRANCH_MIN_TOKENS:
            return False
        self._wanted.setdefault(best.rid, set()).add(shared)
        return True

    def reserve_prompt_snapshots(self, reqs: list["Req"]) -> list[tuple[int, int, int]]:
        snapshots: list[tuple[int, int, int]] = []
        branches: set[TreeNode] = set()  # one snapshot per branch point in a batch
        for i, req in enumerate(reqs):
            asked = self._wanted.pop(req.rid, set())
            if req.pending_snapshots or req.extend_input_len < 2:
                continue
            prefix = len(req.prefix_indices)
            end = prefix + req.extend_input_len
            wanted = {length for length in asked if prefix < length < end}
            later = {length for length in asked if length >= end}
            if later:  # in a later chunk of the prompt: that chunk's pass keeps them
                self._wanted[req.rid] = later
            if end == len(req.origin_input_ids) + len(req.output_ids):
                wanted.add(end - 1)  # not a chunk: the pass ends the prompt
            branch = self._branch_point(req.cache_key(req.fill_ids[:end]), prefix)
            if branch is not None and branch[1] not in branches:
                branches.add(branch[1])
                wanted.add(branch[0])
            for length in sorted(wanted):
                slot = self._take_snapshot_row()
                if slot is None:
                    break
                self._reserved.add(slot)
                req.pending_snapshots.append((slot, length))
                snapshots.append((i, length - prefix, slot))
        return snapshots

    def _branch_point(self, tokens: list[int], prefix: int) -> tuple[int, TreeNode] | None:
        """Where `tokens` part from the cached sequences, past the reused `prefix` by at least
        BRANCH_MIN_TOKENS and before the tokens' end, when no snapshot is kept there: (its
        length, the node ending there). A later prompt that shares the same opening (a system
        prompt) reuses up to it once this request's states there are kept."""
        indices, handle = self._walk(tokens)
        node = _as_node(handle)
        length = len(indices)
        if length - prefix < BRANCH_MIN_TOKENS or length >= len(tokens) or node is None \
                or node.state is not None:
            return None
        return length, node

    # ---- requests ----
    def cache_finished_req(self, req: "Req", token_ids: list[int] | None = None,
                           allocated_len: int | None = None) -> None:
        if token_ids is None:
            token_ids = req.all_ids()[:-1]
        row = req.req_pool_idx
        self._wanted.pop(req.rid, None)  # finished, aborted or retracted: asked no more
        super().cache_finished_req(req, token_ids, allocated_len)
        assert row is not None
        if token_ids:
            self._snapshot(self._walk(req.cache_key(token_ids)), len(token_ids), row)
        self._keep_pending(req, token_ids)

    def cache_unfinished_req(self, req: "Req", token_ids: list[int] | None = None) -> None:
        if token_ids is None:
            token_ids = req.fill_ids
        super().cache_unfinished_req(req, token_ids)
        assert req.req_pool_idx is not None
        if token_ids:  # the request's prefix now ends at its handle, where the tokens end
            self._snapshot(MatchResult(req.prefix_indices, req.cache_handle), len(token_ids),
                           req.req_pool_idx)
        self._keep_pending(req, token_ids)

    def _keep_pending(self, req: "Req", token_ids: list[int]) -> None:
        """The states passes wrote after a prefix of the request's prompt: each at the node
        ending there, where those tokens are cached and the node keeps none yet; else the
        row is free."""
        pending, req.pending_snapshots = req.pending_snapshots, []
        keys = req.cache_key(token_ids) if pending else []
        for slot, length in pending:
            self._reserved.discard(slot)
            node = None
            if 0 < length <= len(token_ids):
                indices, handle = self._walk(keys[:length])
                node = _as_node(handle) if len(indices) == length else None
            if node is None or node.state is not None:
                self._free_snapshots.append(slot)
            else:
                self._keep(node, slot)

    def _snapshot(self, match: MatchResult, length: int, row: int) -> None:
        """Keep the states of `row` (after the `length` tokens the tree now holds, `match` the
        walk to their end) at the node that ends there, unless it keeps some already."""
        node = _as_node(match.handle)
        _require(node is not None and len(match.indices) == length,
                 "tokens just cached are not all in the tree")
        assert node is not None
        if node.state is not None:
            return
        slot = self._take_snapshot_row()
        if slot is None:
            return
        self._keep(node, slot)
        self.state_pool.copy_rows([row], [slot])

    def _keep(self, node: TreeNode, slot: int) -> None:
        node.state = slot
        self._snapshot_nodes.add(node)
        self._push_snapshot(node)

    def _push_snapshot(self, node: TreeNode) -> None:
        self._push_lazy(self._snapshot_heap, self._snapshot_nodes, node, slack=64)

    def _take_snapshot_row(self) -> int | None:
        """A free snapshot row, dropping the least recently used unpinned snapshot if none is
        free; None when every snapshot is pinned. A snapshot is pinned while a request holds
        a lock on its very node (`cache_handle`: it was admitted on that prefix, or it is
        being chunked and ends there), not while locks lie only below it: a request's states
        are its row's once restored (`restore_states`, at admission), and a copy into a row
        reused afterwards is queued behind that restore.

        The snapshot nodes sit in a lazy heap by last access: an entry whose node was touched
        since is pushed again with the new time, one whose node lost its snapshot is dropped,
        pinned ones are set aside and pushed back."""
        if self._free_snapshots:
            return self._free_snapshots.pop()
        heap, pinned, chosen = self._snapshot_heap, [], None
        while heap:
            entry = heapq.heappop(heap)
            used_at, _, _, node = entry
            if node.state is None or node not in self._snapshot_nodes:
                continue
            if node.last_access_time != used_at:
                self._push_snapshot(node)
            elif self._directly_locked(node):
                pinned.append(entry)
            else:
                chosen = node
                break
        for entry in pinned:
            heapq.heappush(heap, entry)
        if chosen is None:
            return None
        self._drop_snapshot(chosen)
        return self._free_snapshots.pop()

    @staticmethod
    def _directly_locked(node: TreeNode) -> bool:
        return node.lock_ref > sum(child.lock_ref for child in node.children.values())

    def _drop_snapshot(self, node: TreeNode) -> None:
        assert node.state is not None
        self._free_snapshots.append(node.state)
        self._snapshot_nodes.discard(node)
        node.state = None

    def _on_evicted(self, node: TreeNode) -> None:
        if node.state is not None:
            self._drop_snapshot(node)

    def check_invariants(self) -> None:
        super().check_invariants()
        in_tree = {n for n in self._nodes() if n.state is not None}
        _require(in_tree == self._snapshot_nodes, "the snapshot set is out of date")
        used = [n.state for n in in_tree] + sorted(self._reserved)
        rows = set(self.state_pool.snapshot_rows())
        _require(len(set(used)) == len(used), "a snapshot row is kept twice")
        _require(set(used) | set(self._free_snapshots) == rows
                 and len(used) + len(self._free_snapshots) == len(rows),
                 "snapshot rows leaked or out of range")

    def format_tree(self) -> str:
        return super().format_tree() + f"\nsnapshots: {len(self._snapshot_nodes)} kept, " \
            f"{len(self._reserved)} being written, {len(self._free_snapshots)} free"
