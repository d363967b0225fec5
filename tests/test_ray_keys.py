"""Route keys and rendezvous ranking of the Ray router (`server.ray.keys`): pure Python, no Ray."""

from __future__ import annotations

import random

from server.ray.keys import Placement, block_hashes, rank_replicas, route_key


def test_a_key_names_the_first_full_blocks_and_nothing_after():
    system = list(range(100, 164))  # 4 blocks of 16
    a = route_key(system + [1, 2, 3], 16)
    assert a == route_key(system + [9] * 40, 16)  # the question does not matter
    assert a != route_key([7] + system[1:] + [1, 2, 3], 16)  # the first token does
    assert route_key(list(range(16)), 16) is None  # the last token never counts: no full block
    assert route_key(list(range(17)), 16) is not None
    # Chained: block 2's hash depends on block 1's tokens.
    x, y = list(range(32)), [99] + list(range(1, 32))
    assert block_hashes(x, 16, 4)[0] != block_hashes(y, 16, 4)[0]
    assert block_hashes(x + [0], 16, 4)[1] != block_hashes(y + [0], 16, 4)[1]


def test_rendezvous_moves_only_the_keys_a_new_replica_wins():
    rng = random.Random(0)
    keys = [route_key([rng.randrange(1000) for _ in range(40)], 16) for _ in range(1000)]
    assert len(set(keys)) == len(keys)
    two = {k: rank_replicas(k, ["a", "b"], {}, 4)[0][0] for k in keys}
    three = {k: rank_replicas(k, ["a", "b", "c"], {}, 4)[0][0] for k in keys}
    moved = [k for k in keys if two[k] != three[k]]
    assert all(three[k] == "c" for k in moved)  # nothing moves between the old replicas
    assert 0.28 < len(moved) / len(keys) < 0.39  # about a third moves to the new one
    assert 0.44 < sum(v == "a" for v in two.values()) / len(keys) < 0.56


def test_the_load_guard_falls_back_to_the_least_loaded():
    key = route_key(list(range(64)), 16)
    preferred = rank_replicas(key, ["a", "b"], {}, 4)[0][0]
    other = "b" if preferred == "a" else "a"
    order, fell_back = rank_replicas(key, ["a", "b"], {preferred: 4, other: 0}, 4)
    assert order[0] == preferred and not fell_back  # within the bound: stay
    order, fell_back = rank_replicas(key, ["a", "b"], {preferred: 5, other: 0}, 4)
    assert order == [other, preferred] and fell_back
    order, fell_back = rank_replicas(None, ["a", "b"], {"a": 2, "b": 1}, 4)
    assert order == ["b", "a"] and not fell_back  # no key: least loaded


def _keys(n: int, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    return [route_key([rng.randrange(1000) for _ in range(40)], 16) for _ in range(n)]


def test_placement_spreads_new_keys_evenly_and_keeps_them():
    # Rendezvous alone splits a few tenants unevenly for some replica ids (one cache then holds
    # more than its share); placement levels them whatever the ids.
    keys = _keys(8)
    uneven = 0
    for ids in (["a", "b"], ["x1", "y2"], ["r-0", "r-1"], ["p", "q"], ["m", "n"]):
        hashed = [rank_replicas(k, ids, {}, 4)[0][0] for k in keys]
        uneven += max(hashed.count(r) for r in ids) > 4
        placement = Placement()
        homes = [rank_replicas(k, ids, {}, 4, placement)[0][0] for k in keys]
        assert sorted(homes.count(r) for r in ids) == [4, 4]
        for _ in range(3):  # sticky: the same key, the same replica, in any order
            for k, home in reversed(list(zip(keys, homes, strict=True))):
                assert rank_replicas(k, ids, {}, 4, placement)[0][0] == home
    assert uneven > 0  # the case placement exists for occurs with these ids


def test_placement_moves_no_placed_key_when_replicas_come_and_go():
    placement = Placement()
    keys = _keys(12)
    before = {k: placement.preferred(k, ["a", "b"])[0] for k in keys}
    after = {k: placement.preferred(k, ["a", "b", "c"])[0] for k in keys}
    assert after == before  # placed keys stay where their blocks are
    fresh = _keys(6, seed=2)
    assert [placement.preferred(k, ["a", "b", "c"])[0] for k in fresh] == ["c"] * 6  # levels c
    placement.forget_replica("a")
    again = {k: placement.preferred(k, ["b", "c"])[0] for k in keys}
    assert all(again[k] == before[k] for k in keys if before[k] == "b")  # b's keys stay
    assert all(again[k] in ("b", "c") for k in keys)


def test_placement_forgets_the_least_recently_used_keys():
    placement = Placement(capacity=4)
    keys = _keys(6)
    for k in keys:
        placement.preferred(k, ["a", "b"])
    assert len(placement.where) == 4 and sum(placement.count.values()) == 4
    assert keys[0] not in placement.where and keys[-1] in placement.where


def test_the_load_guard_applies_to_placed_keys_too():
    placement = Placement()
    key = route_key(list(range(64)), 16)
    home = placement.preferred(key, ["a", "b"])[0]
    other = "b" if home == "a" else "a"
    order, fell_back = rank_replicas(key, ["a", "b"], {home: 5, other: 0}, 4, placement)
    assert order == [other, home] and fell_back
    assert placement.preferred(key, ["a", "b"])[0] == home  # the detour does not move the key
