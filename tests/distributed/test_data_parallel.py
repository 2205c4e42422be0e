"""Data parallelism: --dp-size 2 replicas behind one server give dp 1's outputs with every
load-balance method; round_robin alternates, shortest_queue follows the load, cache_aware keeps
a shared prefix on one replica (more cache hits than round_robin)."""
from __future__ import annotations

import pytest
import requests
import torch

import radixserve
from radixserve.server.dp_router import BALANCE_ABS_THRESHOLD, BLOCK, DataParallelRouter
from tests.models.tiny_checkpoints import make_checkpoint
from tests.server.server_process import ServerProcess


def test_round_robin_and_shortest_queue() -> None:
    rr = DataParallelRouter(3, "round_robin")
    assert [rr.route(f"r{i}", [1, 2]) for i in range(5)] == [0, 1, 2, 0, 1]
    sq = DataParallelRouter(2, "shortest_queue")
    assert [sq.route(f"s{i}", [1]) for i in range(3)] == [0, 1, 0]
    sq.finished("s1")
    sq.finished("s1")  # idempotent
    assert sq.in_flight == [2, 0] and sq.route("s3", [1]) == 1
    assert sq.replica_of("s0") == 0 and sq.replica_of("gone") is None


def test_cache_aware_follows_prefixes_until_the_load_is_unbalanced() -> None:
    router = DataParallelRouter(2, "cache_aware")
    shared = list(range(4 * BLOCK))
    first = router.route("a", shared + [900])
    assert router.route("b", shared + [901]) == first  # the prefix is there
    other = router.route("c", list(range(1000, 1000 + 4 * BLOCK)))
    assert other != first  # no match: the least loaded
    for i in range(BALANCE_ABS_THRESHOLD + 2):  # pile requests onto the first replica
        router.owner[f"x{i}"] = first
        router.in_flight[first] += 1
    assert router.route("d", shared + [902]) == other  # too unbalanced: least loaded wins
    short = router.route("e", [1, 2, 3])  # shorter than a block: least loaded
    assert short == other or router.in_flight[other] > router.in_flight[first]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dp_llama")
    make_checkpoint("llama_gqa_llama3_rope", folder)
    return str(folder)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    shared = torch.randint(0, 160, (4 * BLOCK,), generator=gen).tolist()
    return [shared + torch.randint(0, 160, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]


PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _server_outputs(checkpoint: str, method: str) -> tuple[list[list[int]], dict, int]:
    server = ServerProcess("--model-path", checkpoint, "--dp-size", "2", "--load-balance-method",
                           method, "--dtype", "float32", "--skip-tokenizer-init",
                           "--max-total-tokens", "2048")
    try:
        outs, cached = [], 0
        for prompt in _prompts():  # one at a time: each routing decision sees the last
            r = requests.post(server.url("/generate"),
                              json={"input_ids": prompt, "sampling_params": PARAMS}, timeout=120)
            assert r.status_code == 200, r.text
            outs.append(r.json()["output_ids"])
            cached += r.json()["meta_info"]["cached_tokens"]
        assert requests.post(server.url("/flush_cache"), timeout=60).status_code == 200
        info = server.wait_idle_memory_check()
        return outs, info, cached
    finally:
        assert server.stop() == 0


# every method routes through the same replicas; --run-slow runs all three (19 s each); the
# routing itself: the tests above, in CI
@pytest.mark.parametrize("method", [pytest.param("round_robin", marks=pytest.mark.slow),
                                    pytest.param("shortest_queue", marks=pytest.mark.slow),
                                    pytest.param("cache_aware", marks=pytest.mark.slow)])
def test_dp2_gives_dp1_outputs(checkpoint: str, method: str) -> None:
    engine = radixserve.Engine(checkpoint, dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=2048)
    expected = [o["output_ids"] for o in engine.generate(input_ids=_prompts(),
                                                         sampling_params=PARAMS)]
    outs, info, cached = _server_outputs(checkpoint, method)
    assert outs == expected
    assert len(info["replica_states"]) == 2 and len(info["scheduler_pids"]) == 2
    assert info["internal_state"]["memory_check_ok"] is True
    assert all(s["memory_check_ok"] for s in info["replica_states"])
    assert info["requests_in_flight_per_replica"] == [0, 0]
    shared = 4 * BLOCK
    if method == "cache_aware":  # every request after the first on the prefix's replica
        assert cached >= 3 * (shared - 1)
    if method == "round_robin":  # two replicas each miss the prefix once
        assert cached < 3 * (shared - 1)
