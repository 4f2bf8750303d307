"""The page allocator's three sets (kvcached.core.pagesets), each on its own: random operations
against a plain Python model with the set's check after every step, and each check shown to
fail on a corrupted field. The sets are held in numpy arrays through the test hooks of kvcached.core._probes;
the ledger's check across them is shown to pass a consistent ledger and fail on each invariant."""

import random

import numpy as np
import pytest

from kvcached.core import _probes as probes


def random_set(rng: random.Random, sizes: list[int], lowest_weight: int) -> tuple[int, list[int]]:
    """A size drawn from `sizes` and a random weight per id."""
    size = rng.choice(sizes)
    return size, [rng.randint(lowest_weight, 9) for _ in range(size)]


def spare_id(rng: random.Random, size: int, taken) -> int:
    return rng.choice([q for q in range(size) if q not in taken])


@pytest.mark.parametrize("seed", range(4))
def test_free_set_random_against_a_model(seed):
    rng = random.Random(seed)
    size, weight = random_set(rng, [1, 7, 64, 100], lowest_weight=1)
    fs = probes.new_free_set(weight)
    model: set[int] = set()
    for _ in range(400):
        op = rng.choice(["add", "remove", "pop_lowest", "query"])
        if op == "add" and len(model) < size:
            p = spare_id(rng, size, model)
            probes.free_set_step(fs, "add", p)
            model.add(p)
        elif op == "remove" and model:
            p = rng.choice(sorted(model))
            probes.free_set_step(fs, "remove", p)
            model.discard(p)
        elif op == "pop_lowest" and model:
            assert probes.free_set_step(fs, "pop_lowest") == min(model)
            model.discard(min(model))
        else:
            lowest = sorted(model)
            k = rng.randint(0, len(lowest))
            assert probes.free_set_step(fs, "weight_of_lowest", k) == sum(weight[p] for p in lowest[:k])
            need = rng.randint(1, sum(weight) + 1)
            prefix = np.cumsum([weight[p] for p in lowest])
            want = int(np.searchsorted(prefix, need)) + 1 if lowest and prefix[-1] >= need else -1
            assert probes.free_set_step(fs, "count_for_weight", need) == want
        probes.free_set_step(fs, "check")
        assert fs["num"] == len(model)
        assert np.flatnonzero(probes.free_set_step(fs, "members")).tolist() == sorted(model)


@pytest.mark.parametrize("seed", range(4))
def test_pool_random_against_a_model(seed):
    rng = random.Random(seed)
    size, weight = random_set(rng, [1, 10, 50], lowest_weight=0)
    pool = probes.new_pool(weight)
    model: list[int] = []
    for _ in range(300):
        op = rng.choice(["push", "push", "pop", "drop"])
        if op == "push" and len(model) < size:
            p = spare_id(rng, size, model)
            probes.pool_step(pool, "push", p)
            model.append(p)
        elif op == "pop" and model:
            assert probes.pool_step(pool, "pop") == model.pop()
        elif op == "drop":
            below, keep = rng.randint(0, size), rng.randint(0, size)
            above = [p for p in model if p >= below]
            model = [p for p in model if p < below]
            top = model[keep:][::-1]
            model = model[:keep]
            assert probes.pool_step(pool, "drop", below, keep) == above + top
        probes.pool_step(pool, "check")
        assert pool["ids"][:pool["num"]].tolist() == model
        assert pool["weight_sum"] == sum(weight[p] for p in model)


@pytest.mark.parametrize("seed", range(4))
def test_pending_ring_random_against_a_model(seed):
    rng = random.Random(seed)
    size = rng.choice([1, 8, 40])
    ring = probes.new_pending_ring(size)
    batches: list[tuple[int, list[int]]] = []
    retries: list[int] = []
    fence = 0
    for _ in range(300):
        held = {p for _, ids in batches for p in ids} | set(retries)
        spare = [p for p in range(size) if p not in held]
        op = rng.choice(["push", "push", "pop", "retry", "take_retries"])
        if op == "push" and spare:
            ids = rng.sample(spare, rng.randint(1, len(spare)))
            fence += 1
            probes.pending_step(ring, "push", ids, fence)
            batches.append((fence, ids))
        elif op == "pop" and batches:
            assert probes.pending_step(ring, "pop") == batches.pop(0)
        elif op == "retry" and spare:
            ids = rng.sample(spare, rng.randint(1, len(spare)))
            probes.pending_step(ring, "retry", ids)
            retries += ids
        elif op == "take_retries":
            assert probes.pending_step(ring, "take_retries") == retries
            retries = []
        probes.pending_step(ring, "check")
        assert probes.pending_step(ring, "copy") == [p for _, ids in batches for p in ids] + retries
        assert ring["num_batches"] == len(batches)


def filled_free_set():
    fs = probes.new_free_set([3, 1, 4, 1, 5, 9, 2, 6])
    for p in (1, 2, 5, 6):
        probes.free_set_step(fs, "add", p)
    probes.free_set_step(fs, "check")
    return fs


@pytest.mark.parametrize("corrupt, message", [
    (lambda fs: fs["count"].__setitem__(3, fs["count"][3] + 1), "page id 2 is in it"),
    (lambda fs: fs["weight_sum"].__setitem__(6, fs["weight_sum"][6] - 1), "page id 5 has weight"),
    (lambda fs: fs.__setitem__("num", fs["num"] + 1), "the tree holds 4 ids, num says 5"),
])
def test_free_set_check_fails_on_a_corrupted_field(corrupt, message):
    fs = filled_free_set()
    corrupt(fs)
    with pytest.raises(AssertionError, match=message):
        probes.free_set_step(fs, "check")


@pytest.mark.parametrize("corrupt, message", [
    (lambda pool: pool["ids"].__setitem__(1, pool["ids"][0]), "page id 4 at 1 is out of range or repeated"),
    (lambda pool: pool["ids"].__setitem__(0, 99), "page id 99 at 0"),
    (lambda pool: pool.__setitem__("weight_sum", 0), "weights sum to 9, weight_sum says 0"),
    (lambda pool: pool.__setitem__("num", 11), "11 ids, outside"),
])
def test_pool_check_fails_on_a_corrupted_field(corrupt, message):
    pool = probes.new_pool([1, 2, 3, 4, 5, 0, 0, 0, 0, 0])
    for p in (4, 0, 2):
        probes.pool_step(pool, "push", p)
    probes.pool_step(pool, "check")
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        probes.pool_step(pool, "check")


@pytest.mark.parametrize("corrupt, message", [
    (lambda ring: ring["count"].__setitem__(0, 1), "batches hold 3 ids, num_fenced says 4"),
    (lambda ring: ring["count"].__setitem__(1, 0), "batch 1 holds 0 ids"),
    (lambda ring: ring["ids"].__setitem__(1, 7), "page id 7 .* repeated"),
    (lambda ring: ring.__setitem__("num_retry", 2), "page id 0 .* repeated"),
    (lambda ring: ring.__setitem__("num_batches", 9), "outside its size 8"),
])
def test_pending_ring_check_fails_on_a_corrupted_field(corrupt, message):
    ring = probes.new_pending_ring(8)
    probes.pending_step(ring, "push", [3, 5], 11)
    probes.pending_step(ring, "push", [7, 0], 12)
    probes.pending_step(ring, "retry", [6])
    probes.pending_step(ring, "check")
    corrupt(ring)
    with pytest.raises(AssertionError, match=message):
        probes.pending_step(ring, "check")


def test_unknown_op_names_the_choices():
    with pytest.raises(ValueError, match="unknown pool op 'shuffle'; use push, pop, drop or check"):
        probes.pool_step(probes.new_pool([1]), "shuffle")


# The ledger: ids 0..5 below capacity 6 and ids 6, 7 above; 0 free, 1 pool, 2 used, 3 pending,
# 4 free, 5 outside (weight 0), 6 and 7 outside. Each case breaks one invariant of the one before.
LEDGER = {"state": [1, 2, 3, 4, 1, 0, 0, 0], "weight": [1, 2, 1, 1, 3, 0, 1, 1], "capacity": 6,
          "mapped": [0, 1, 1, 1, 0, 0, 0, 0], "pool_ids": [1], "pending_ids": [3]}


def test_ledger_check_passes_a_consistent_ledger():
    probes.ledger_check_step(**LEDGER)


@pytest.mark.parametrize("change, message", [
    ({"pool_ids": []}, "page id 1 is in state 2 but held by the set of state 0"),
    ({"pending_ids": [3, 0]}, "page id 0 is in state 1 but held by the set of state 255"),
    ({"num_used": 2}, "the counts say 2/1/2/1/0"),
    ({"capacity": 4}, "page id 4 is free at or above capacity 4"),
    ({"weight": [0, 2, 1, 1, 3, 0, 1, 1]}, "free page id 0 holds no block"),
    ({"weight": [1, 2, 1, 1, 3, 5, 1, 1]}, "page id 5 below capacity is lost"),
    ({"mapped": [0, 1, 0, 1, 0, 0, 0, 0]}, "page id 2 in state 3 is unmapped in the table"),
    ({"mapped": [0, 1, 2, 1, 0, 0, 0, 0]}, "page id 2 in state 3 is partly unmapped in the table"),
    ({"state": [1, 2, 3, 4, 1, 0, 0, 9]}, "page id 7 has no state"),
])
def test_ledger_check_fails_on_each_broken_invariant(change, message):
    with pytest.raises(AssertionError, match=message):
        probes.ledger_check_step(**{**LEDGER, **change})
