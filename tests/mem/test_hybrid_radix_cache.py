"""HybridRadixCache: prefixes end where recurrent states are kept; snapshots taken when a
request is cached, restored into a new row, dropped least recently used first (never a locked
prefix's), freed with their node; every row accounted for."""
from __future__ import annotations

import torch

from mem_cache_sim import make_pools, make_req
from radixserve.mem.hybrid_radix_cache import HybridRadixCache
from radixserve.mem.recurrent_state_pool import RecurrentStatePool, RecurrentStateSpec

SPEC = RecurrentStateSpec(num_layers=2, conv_channels=3, conv_width=2, num_heads=1, key_dim=2,
                          value_dim=2, conv_dtype=torch.float32)


def new_cache(snapshots: int = 2, kv_size: int = 64) -> HybridRadixCache:
    req_pool, kv_pool = make_pools(kv_size=kv_size, req_slots=4)
    states = RecurrentStatePool(SPEC, req_pool.size, "cpu", snapshots)
    return HybridRadixCache(req_pool, kv_pool, states)


def run_request(cache: HybridRadixCache, tokens: list[int], mark: float, finish: bool = True):
    """A request that computed `tokens` (its row's states all `mark`), then is cached."""
    req = make_req(f"r{mark}", tokens + [0])
    indices, handle = cache.match_prefix(tokens)
    req.prefix_indices, req.cache_handle = indices, handle
    cache.inc_lock_ref(handle)
    req.req_pool_idx = cache.req_to_token_pool.alloc(1)[0]
    cache.req_to_token_pool.write(req.req_pool_idx, 0, indices)
    new = cache.token_to_kv_pool.alloc(len(tokens) - len(indices))
    cache.req_to_token_pool.write(req.req_pool_idx, len(indices), new)
    cache.state_pool.conv[:, req.req_pool_idx] = mark
    cache.state_pool.ssm[:, req.req_pool_idx] = mark
    req.fill_ids = list(tokens)
    if finish:
        cache.cache_finished_req(req, token_ids=list(tokens))
    else:
        cache.cache_unfinished_req(req)
    cache.check_invariants()
    return req


def kept(cache: HybridRadixCache) -> list[tuple[int, float]]:
    """(prefix length, the value its snapshot holds) for each kept snapshot, sorted."""
    out = []
    for node in cache._snapshot_nodes:
        length, walk = 0, node
        while walk is not cache.root:
            length += len(walk.key)
            walk = walk.parent
        out.append((length, float(cache.state_pool.ssm[0, node.state].flatten()[0])))
    return sorted(out)


def test_matches_stop_at_the_deepest_kept_states() -> None:
    cache = new_cache()
    run_request(cache, [1, 2, 3, 4, 5, 6], 1.0)
    assert kept(cache) == [(6, 1.0)]
    # the same first four tokens: the KV is there, the states only after six tokens
    assert len(cache.match_prefix([1, 2, 3, 4, 9]).indices) == 0
    indices, handle = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert len(indices) == 6 and handle.state is not None
    cache.check_invariants()


def test_restore_copies_the_kept_states_into_the_new_row() -> None:
    cache = new_cache()
    run_request(cache, [1, 2, 3], 2.5)
    indices, handle = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(handle)
    row = cache.req_to_token_pool.alloc(1)[0]
    cache.restore_states([row], [handle])
    assert bool((cache.state_pool.conv[:, row] == 2.5).all())
    assert bool((cache.state_pool.ssm[:, row] == 2.5).all())
    cache.restore_states([row], [cache.root])  # the empty prefix: nothing to copy
    cache.dec_lock_ref(handle)
    cache.check_invariants()


def test_unfinished_requests_keep_states_at_their_chunk_ends() -> None:
    cache = new_cache()
    req = run_request(cache, [5, 6, 7, 8], 3.0, finish=False)
    assert kept(cache) == [(4, 3.0)]
    cache.dec_lock_ref(req.cache_handle)
    cache.check_invariants()


def test_the_least_recently_used_unlocked_snapshot_is_dropped_for_a_new_one() -> None:
    cache = new_cache(snapshots=2)
    run_request(cache, [1, 1], 1.0)
    run_request(cache, [2, 2], 2.0)
    cache.match_prefix([1, 1, 9])  # [1, 1] used last
    run_request(cache, [3, 3], 3.0)
    assert kept(cache) == [(2, 1.0), (2, 3.0)]
    # the KV of the dropped prefix is still cached, its states are not
    assert cache.total_size() == 6
    assert len(cache.match_prefix([2, 2, 5]).indices) == 0
    # both kept snapshots locked: a fourth request keeps none
    handles = [cache.match_prefix(k).handle for k in ([1, 1, 0], [3, 3, 0])]
    for handle in handles:
        cache.inc_lock_ref(handle)
    run_request(cache, [4, 4], 4.0)
    assert kept(cache) == [(2, 1.0), (2, 3.0)]
    for handle in handles:
        cache.dec_lock_ref(handle)
    cache.check_invariants()


def test_evicted_nodes_free_their_snapshots_and_reset_frees_all() -> None:
    cache = new_cache(snapshots=2)
    run_request(cache, [1, 2], 1.0)
    run_request(cache, [7, 8, 9], 2.0)
    assert cache.evict(5) == 5
    assert kept(cache) == [] and len(cache._free_snapshots) == 2
    cache.check_invariants()
    run_request(cache, [1, 2], 1.0)
    cache.reset()
    assert len(cache._free_snapshots) == 2 and not cache._snapshot_nodes


def test_a_chunked_request_pins_only_the_snapshot_it_is_locked_on() -> None:
    """A prompt cached chunk by chunk holds its lock at its latest chunk end: the earlier
    chunk end's snapshot (locked only through its subtree) goes first when a finishing
    request needs a row."""
    cache = new_cache(snapshots=2)
    req = run_request(cache, [1, 2, 3, 4], 1.0, finish=False)
    req.fill_ids = [1, 2, 3, 4, 5, 6, 7, 8]
    new = cache.token_to_kv_pool.alloc(4)
    cache.req_to_token_pool.write(req.req_pool_idx, 4, new)
    cache.state_pool.ssm[:, req.req_pool_idx] = 2.0
    cache.cache_unfinished_req(req)
    assert kept(cache) == [(4, 1.0), (8, 2.0)]
    run_request(cache, [9, 9], 3.0)
    assert kept(cache) == [(2, 3.0), (8, 2.0)]
    cache.dec_lock_ref(req.cache_handle)
    cache.check_invariants()


def test_rows_reserved_for_a_prompts_last_pass_are_kept_or_freed() -> None:
    """A row reserved at batch build (the pass writes the states before the prompt's last
    token into it) is kept at that prefix when the request is cached, or freed where the node
    keeps states already; either way every row stays accounted for."""
    cache = new_cache(snapshots=3)
    req = make_req("p", [1, 2, 3, 4])
    req.fill_ids, req.extend_input_len = [1, 2, 3, 4], 4
    snapshots = cache.reserve_prompt_snapshots([req])
    assert len(snapshots) == 1 and snapshots[0][:2] == (0, 3)  # request 0, after 3 tokens
    assert req.pending_snapshots == [(snapshots[0][2], 3)]
    cache.check_invariants()
    short = make_req("s", [7])
    short.fill_ids, short.extend_input_len = [7], 1
    assert cache.reserve_prompt_snapshots([short]) == []  # one token: nothing before it
    run_done = run_request(cache, [1, 2, 3, 4], 1.0, finish=False)  # the tree gets [1..4]
    cache.dec_lock_ref(run_done.cache_handle)
    cache._keep_pending(req, [1, 2, 3, 4])
    assert [length for length, _ in kept(cache)] == [3, 4]
    assert req.pending_snapshots == []
    again = make_req("q", [1, 2, 3, 4])
    again.fill_ids, again.extend_input_len = [1, 2, 3, 4], 4
    cache.reserve_prompt_snapshots([again])
    cache._keep_pending(again, [1, 2, 3, 4])  # [1, 2, 3] keeps states already
    assert [length for length, _ in kept(cache)] == [3, 4]
    cache.check_invariants()


def test_a_prompt_keeps_its_states_where_it_parts_from_a_cached_one(monkeypatch) -> None:
    """Two prompts sharing an opening of 5 tokens (a system prompt): the second, reusing
    nothing (no states kept at 5), is cut there by its pass; once cached, a third prompt with
    the same opening reuses those 5 tokens. Branch points short of BRANCH_MIN_TOKENS past the
    reused prefix, or at the tokens' end, get no row."""
    from radixserve.mem import hybrid_radix_cache
    monkeypatch.setattr(hybrid_radix_cache, "BRANCH_MIN_TOKENS", 3)
    cache = new_cache(snapshots=4)
    run_request(cache, [1, 2, 3, 4, 5, 6, 7], 1.0)
    second = make_req("b", [1, 2, 3, 4, 5, 8, 9])
    assert len(cache.match_prefix(second.origin_input_ids).indices) == 0
    second.fill_ids, second.extend_input_len = list(second.origin_input_ids), 7
    snapshots = cache.reserve_prompt_snapshots([second])
    assert [s[:2] for s in snapshots] == [(0, 5), (0, 6)]  # the branch, the last token
    done = run_request(cache, [1, 2, 3, 4, 5, 8, 9], 2.0, finish=False)
    cache.dec_lock_ref(done.cache_handle)
    cache.state_pool.ssm[:, snapshots[0][2]] = 5.0  # what the pass wrote at the branch
    cache._keep_pending(second, second.fill_ids)
    assert (5, 5.0) in kept(cache)
    indices, handle = cache.match_prefix([1, 2, 3, 4, 5, 10, 11])
    assert len(indices) == 5 and handle.state == snapshots[0][2]
    # a branch 1 token past the reused prefix, or at the tokens' end: no row for it
    near = make_req("n", [1, 2, 3, 4, 5, 6, 12, 13])
    near.prefix_indices = indices
    near.fill_ids, near.extend_input_len = list(near.origin_input_ids), 3
    assert [s[1] for s in cache.reserve_prompt_snapshots([near])] == [2]  # the last token only
    whole = make_req("w", [1, 2, 3, 4, 5, 6, 7, 20])
    whole.fill_ids, whole.extend_input_len = [1, 2, 3, 4, 5, 6, 7], 7  # a chunk: no tail
    assert cache.reserve_prompt_snapshots([whole]) == []
    for req in (near, whole):
        cache._keep_pending(req, [])
    cache.check_invariants()


def test_a_prompt_waits_behind_an_admitted_one_sharing_its_opening(monkeypatch) -> None:
    """Nothing cached: a waiting prompt sharing 5 tokens with one admitted to this batch
    waits (the admitted one's pass is asked for its states at 5, its branch with the other);
    one sharing fewer than BRANCH_MIN_TOKENS does not."""
    from radixserve.mem import hybrid_radix_cache
    monkeypatch.setattr(hybrid_radix_cache, "BRANCH_MIN_TOKENS", 3)
    cache = new_cache(snapshots=4)
    admitted = make_req("a", [1, 2, 3, 4, 5, 6, 7])
    admitted.fill_ids, admitted.extend_input_len = list(admitted.origin_input_ids), 7
    waiting = make_req("w", [1, 2, 3, 4, 5, 9])
    waiting.fill_ids = list(waiting.origin_input_ids)
    other = make_req("o", [1, 2, 9])
    other.fill_ids = list(other.origin_input_ids)
    assert cache.waits_behind(waiting, [other, admitted])  # the one sharing most
    short = make_req("s", [1, 2, 8])
    short.fill_ids = list(short.origin_input_ids)
    assert not cache.waits_behind(short, [admitted]) and not cache.waits_behind(short, [])
    # a prompt that is the admitted one's opening: its states before its own last token
    opening = make_req("p", [1, 2, 3, 4, 5])
    opening.fill_ids = list(opening.origin_input_ids)
    assert cache.waits_behind(opening, [admitted])
    snapshots = cache.reserve_prompt_snapshots([admitted])
    assert [s[:2] for s in snapshots] == [(0, 4), (0, 5), (0, 6)]  # the opening's end - 1,
    # where the two part, the admitted one's last token
    cache._keep_pending(admitted, [])
    cache.check_invariants()


def test_a_point_in_a_later_chunk_waits_for_that_chunk(monkeypatch) -> None:
    """The admitted prompt is chunked [0, 4) then [4, 7): where the waiting one parts from it
    (5) is kept by the second chunk's pass; a request cached as finished is asked no more."""
    from radixserve.mem import hybrid_radix_cache
    monkeypatch.setattr(hybrid_radix_cache, "BRANCH_MIN_TOKENS", 3)
    cache = new_cache(snapshots=4)
    admitted = make_req("a", [1, 2, 3, 4, 5, 6, 7])
    admitted.fill_ids, admitted.extend_input_len = [1, 2, 3, 4], 4
    waiting = make_req("w", [1, 2, 3, 4, 5, 9, 9])
    waiting.fill_ids = list(waiting.origin_input_ids)
    assert cache.waits_behind(waiting, [admitted])
    assert cache.reserve_prompt_snapshots([admitted]) == []  # nothing in this chunk
    admitted.prefix_indices = torch.arange(4)
    admitted.fill_ids, admitted.extend_input_len = list(admitted.origin_input_ids), 3
    assert [s[:2] for s in cache.reserve_prompt_snapshots([admitted])] == [(0, 1), (0, 2)]
    cache._keep_pending(admitted, [])
    assert cache.waits_behind(waiting, [admitted]) and cache._wanted
    done = run_request(cache, [8, 8, 8], 1.0, finish=False)
    done.rid = admitted.rid
    cache.cache_finished_req(done, token_ids=[8, 8, 8])
    assert not cache._wanted
    cache.check_invariants()
