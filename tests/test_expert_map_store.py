"""Tests of the fMoE expert map store (search, deduplication, persistence) and of selection/priorities."""

import os

import numpy as np
import pytest
from fmoe_jax.offload.policies.fmoe import store as store_module
from fmoe_jax.offload.policies.fmoe.prefix_dots import PrefixDots
from fmoe_jax.offload.policies.fmoe.select import (
    MASS_TOLERANCE,
    SortedMaps,
    descending_order,
    keep_priority,
    prefetch_priority,
    select_experts,
    select_mask,
)
from fmoe_jax.offload.policies.fmoe.store import ExpertMapStore
from hypothesis import given, settings
from hypothesis import strategies as st

# Cosines are float32 dot products of short vectors: a few ulp of error.
COS_ATOL = 1e-5
L, J, H = 4, 6, 32


def _probs(rng, rows, layers=L, experts=J):
    logits = rng.standard_normal((rows, layers, experts)) * 2.0
    p = np.exp(logits)
    return (p / p.sum(-1, keepdims=True)).astype(np.float32)


def _data(seed, rows, embed_dim=H):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, embed_dim)).astype(np.float32), _probs(rng, rows)


def _store(capacity=8, prefetch_distance=1, **kw):
    return ExpertMapStore(
        capacity=capacity, num_layers=L, num_experts=J, embed_dim=H, prefetch_distance=prefetch_distance, **kw
    )


def _cos(a, b):  # [B, D] x [C, D] -> [B, C], float64 reference
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a @ b.T) / np.linalg.norm(a, axis=1)[:, None] / np.linalg.norm(b, axis=1)[None, :]


# One store per search mode: exact, and sketch shortlist + exact rerank (rerank < capacity).
SEARCH_MODES = [dict(sketch_dim=None), dict(sketch_dim=8, rerank=4)]


@pytest.mark.parametrize("mode", SEARCH_MODES, ids=["exact", "sketch"])
def test_identical_context_finds_its_own_map(mode):
    embeds, maps = _data(0, 20)
    store = _store(capacity=20, **mode)
    store.add(embeds, maps)
    scores, found = store.match_embed(embeds)
    np.testing.assert_allclose(scores, 1.0, rtol=0, atol=COS_ATOL)
    np.testing.assert_array_equal(found, maps)
    for observed in range(1, L + 1):
        scores, found = store.match_traj(maps[:, :observed])
        np.testing.assert_allclose(scores, 1.0, rtol=0, atol=COS_ATOL)
        np.testing.assert_array_equal(found, maps)


@pytest.mark.parametrize("mode", SEARCH_MODES, ids=["exact", "sketch"])
def test_match_scores_are_exact_cosines(mode):
    embeds, maps = _data(1, 30)
    queries, query_maps = _data(2, 5)
    store = _store(capacity=30, **mode)
    store.add(embeds, maps)

    scores, found = store.match_embed(queries)
    ref = _cos(queries, embeds)
    best = np.array([np.flatnonzero((found[b] == maps).all(axis=(1, 2)))[0] for b in range(len(found))])
    # Whichever map is returned, its score is the exact cosine of its embedding.
    np.testing.assert_allclose(scores, ref[np.arange(5), best], rtol=0, atol=COS_ATOL)
    if mode["sketch_dim"] is None:
        np.testing.assert_allclose(scores, ref.max(axis=1), rtol=0, atol=COS_ATOL)

    for observed in (1, 2, L):
        scores, found = store.match_traj(query_maps[:, :observed])
        ref = _cos(query_maps[:, :observed].reshape(5, -1), maps[:, :observed].reshape(30, -1))
        np.testing.assert_allclose(scores, ref.max(axis=1), rtol=0, atol=COS_ATOL)
        np.testing.assert_array_equal(found, maps[ref.argmax(axis=1)])


def test_running_trajectory_search_equals_a_fresh_one(tmp_path):
    """`PrefixDots` adds one layer per search; it finds what a fresh search finds, and starts over when the
    earlier layers differ (a new iteration, other rows) or the store has changed."""
    embeds, maps = _data(3, 30)
    store = _store(capacity=40)
    store.add(embeds, maps)
    running = PrefixDots()

    def check(query):
        for observed in range(1, L + 1):
            scores, found = store.match_traj(query[:, :observed], running)
            ref_scores, ref_found = store.match_traj(query[:, :observed])
            np.testing.assert_allclose(scores, ref_scores, rtol=0, atol=COS_ATOL)
            np.testing.assert_array_equal(found, ref_found)

    first, second = _data(4, 3)[1], _data(5, 3)[1]
    check(first)
    check(second)  # other maps, same batch size: layer 0 differs, so the sums start over
    check(second[:2])  # fewer rows
    check(first[:1])  # one row (decode): its own path, with the batched path's float32 numbers
    sims = running._dots * store._inv_prefix_norm[L - 1, : len(store)]
    sims *= (1.0 / np.maximum(np.sqrt(running._squares), 1e-12)).astype(np.float32)[:, None]
    scores, found = store.match_traj(first[:1], running)  # all L layers summed: nothing to add
    assert scores.dtype == np.float32 and scores[0] == min(sims.max(), np.float32(1.0))
    np.testing.assert_array_equal(found, store.maps[[int(sims.argmax())]])
    store.add(*_data(6, 5))  # the store changes between two searches of one iteration
    scores, found = store.match_traj(second[:2], running)
    ref_scores, ref_found = store.match_traj(second[:2])
    np.testing.assert_allclose(scores, ref_scores, rtol=0, atol=COS_ATOL)
    np.testing.assert_array_equal(found, ref_found)
    # Skipped layers are summed on the next search: after layer 0, straight to all L layers.
    store.match_traj(first[:, :1], running)
    np.testing.assert_allclose(
        store.match_traj(first, running)[0], store.match_traj(first)[0], rtol=0, atol=COS_ATOL
    )
    # The layer-by-layer copy of the maps the running search reads follows replacements and loading.
    store.add(*_data(7, 30))  # past capacity: redundant maps are replaced
    check(first)
    meta = dict(num_layers=L, num_experts=J, embed_dim=H, prefetch_distance=1)
    store.save(tmp_path / "store.npz", {})
    store = ExpertMapStore.load(tmp_path / "store.npz", meta)
    check(second)


def test_sketch_finds_a_clear_best_among_many():
    rng = np.random.default_rng(3)
    embeds = rng.standard_normal((500, H)).astype(np.float32)
    maps = _probs(rng, 500)
    store = _store(capacity=500, sketch_dim=16, rerank=32)
    store.add(embeds, maps)
    target = [7, 123, 499]
    noisy = embeds[target] + 0.1 * rng.standard_normal((3, H)).astype(np.float32)
    scores, found = store.match_embed(noisy)
    np.testing.assert_array_equal(found, maps[target])
    np.testing.assert_allclose(scores, _cos(noisy, embeds).max(axis=1), rtol=0, atol=COS_ATOL)


def test_empty_store_matches_with_zero_scores_and_zero_maps():
    store = _store()
    scores, found = store.match_embed(np.ones((2, H), np.float32))
    np.testing.assert_array_equal(scores, np.zeros(2))
    np.testing.assert_array_equal(found, np.zeros((2, L, J)))
    scores, found = store.match_traj(np.ones((3, 2, J), np.float32))
    np.testing.assert_array_equal(scores, np.zeros(3))
    assert found.shape == (3, L, J) and not found.any()
    assert select_experts(found[0, 0], scores[0], top_k=2).size == 0


def _one_hot_maps(expert):  # [1, L, J]: every layer routes all mass to `expert`
    m = np.zeros((1, L, J), np.float32)
    m[..., expert] = 1.0
    return m


def _unit(i):  # [1, H]
    e = np.zeros((1, H), np.float32)
    e[0, i] = 1.0
    return e


@pytest.mark.parametrize(
    ("prefetch_distance", "replaced"),
    # RDY = (d/L) cos_sem + (1 - d/L) cos_traj. Slot 0 shares the embedding, slot 1 the map.
    [(1, 1), (3, 0)],
)
def test_full_store_replaces_the_most_redundant_map(prefetch_distance, replaced):
    store = _store(capacity=3, prefetch_distance=prefetch_distance)
    store.add(_unit(0), _one_hot_maps(0))  # slot 0: same embedding, orthogonal map
    store.add(_unit(1), _one_hot_maps(1))  # slot 1: orthogonal embedding, same map
    store.add(_unit(2), _one_hot_maps(2))  # slot 2: nothing shared
    new_embed, new_map = _unit(0), _one_hot_maps(1)
    slots = store.add(new_embed, new_map)
    np.testing.assert_array_equal(slots, [replaced])
    assert len(store) == 3
    np.testing.assert_array_equal(store.maps[replaced], new_map[0])
    np.testing.assert_array_equal(store.embeds[replaced], new_embed[0])
    # The new entry now matches itself exactly, under both searches.
    scores, found = store.match_traj(new_map[:, :2])
    np.testing.assert_allclose(scores, [1.0], rtol=0, atol=COS_ATOL)
    np.testing.assert_array_equal(found, new_map)


def test_batch_fills_then_replaces_within_one_call():
    store = _store(capacity=2)
    embeds = np.concatenate([_unit(0), _unit(1), _unit(1)])
    maps = np.concatenate([_one_hot_maps(0), _one_hot_maps(1), _one_hot_maps(1)])
    slots = store.add(embeds, maps)
    # The third row is a duplicate of the second, stored by the same call: it replaces it.
    np.testing.assert_array_equal(slots, [0, 1, 1])
    assert len(store) == 2


def test_batch_rows_do_not_collide_on_one_old_slot():
    # Old slots: A (slot 0), B (slot 1). Both new rows are closest to A, but X2 is closer to B
    # than to X1. Sequentially: X1 replaces A; then X2 sees X1 instead of A and replaces B.
    store = _store(capacity=2, prefetch_distance=0)  # trajectory similarity only
    a = np.full((1, L, J), 1.0 / J, np.float32)
    b = _one_hot_maps(3)
    store.add(np.ones((2, H), np.float32), np.concatenate([a, b]))
    x1 = _one_hot_maps(0) * 0.5 + a * 0.5
    x2 = _one_hot_maps(3) * 0.2 + a * 0.8
    old = np.concatenate([a, b]).reshape(2, -1)
    new = np.concatenate([x1, x2]).reshape(2, -1)
    np.testing.assert_array_equal(_cos(new, old).argmax(axis=1), [0, 0])  # both closest to A
    assert _cos(new[1:], new[:1])[0, 0] < _cos(new[1:], old[1:])[0, 0]  # X2 is closer to B than to X1
    slots = store.add(np.ones((2, H), np.float32), np.concatenate([x1, x2]))
    np.testing.assert_array_equal(slots, [0, 1])
    np.testing.assert_array_equal(store.maps, np.concatenate([x1, x2]))


@pytest.mark.parametrize("mode", SEARCH_MODES, ids=["exact", "sketch"])
def test_batch_add_equals_single_adds_in_order(mode):
    embeds, maps = _data(4, 40)
    batched, single = _store(capacity=12, **mode), _store(capacity=12, **mode)
    batched.add(embeds[:5], maps[:5])
    single.add(embeds[:5], maps[:5])
    slots = batched.add(embeds[5:], maps[5:])
    singles = np.concatenate([single.add(embeds[i : i + 1], maps[i : i + 1]) for i in range(5, 40)])
    np.testing.assert_array_equal(slots, singles)
    np.testing.assert_array_equal(batched.maps, single.maps)
    np.testing.assert_array_equal(batched.embeds, single.embeds)


@pytest.mark.parametrize("prefetch_distance", [1, 2, 3])
def test_sketched_add_replaces_the_slot_rescoring_every_candidate_would(prefetch_distance):
    """`add` rescores the shortlist's likeliest candidates first and the rest only where one of them could
    still win (`_most_redundant`): the same slots as rescoring all, both ways, near-duplicates included."""

    class RescoresAll(ExpertMapStore):
        def _most_redundant(self, cand, unit, traj):
            w = self.semantic_weight
            return int(cand[np.argmax(w * self._exact(cand, unit) + (1.0 - w) * traj)])

    kw = dict(capacity=120, prefetch_distance=prefetch_distance, sketch_dim=8, rerank=48)
    fast, full = _store(**kw), _store(**kw)
    full.__class__ = RescoresAll
    rescored = []  # rows each `_exact` call of the fast store reads
    exact = fast._exact
    fast._exact = lambda cand, unit: rescored.append(len(cand)) or exact(cand, unit)
    rng = np.random.default_rng(11)
    embeds, maps = _data(5, 400)
    for i in range(400):
        e, m = embeds[i : i + 1], maps[i : i + 1]
        if i >= 120 and i % 3 == 0:  # a near-duplicate of a stored row, or an exact one
            j = int(rng.integers(len(fast)))
            noise = rng.standard_normal((1, H)).astype(np.float32)
            e = fast.embeds[j][None] + (0.0 if i % 2 else 1e-3) * noise
            m = fast.maps[j][None].copy()
        np.testing.assert_array_equal(fast.add(e, m), full.add(e, m))
    np.testing.assert_array_equal(fast.maps, full.maps)
    np.testing.assert_array_equal(fast.embeds, full.embeds)
    first = store_module.FIRST_RERANKED
    assert rescored.count(first) > 0 and rescored.count(kw["rerank"]) > 0  # both ways were taken


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(1, 6),
    batches=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_capacity_is_never_exceeded(capacity, batches, seed):
    store = _store(capacity=capacity)
    added = 0
    for i, rows in enumerate(batches):
        embeds, maps = _data(seed + i, rows)
        slots = store.add(embeds, maps)
        added += rows
        assert len(store) == min(added, capacity)
        assert slots.shape == (rows,) and np.all((0 <= slots) & (slots < capacity))
        assert store.maps.shape == (len(store), L, J)


def test_save_load_round_trip(tmp_path):
    embeds, maps = _data(5, 10)
    store = _store(capacity=16, prefetch_distance=2)
    store.add(embeds, maps)
    path = tmp_path / "store.npz"
    meta = {"model": "tiny-mixtral"}
    store.save(path, meta)
    store.save(path, meta)  # overwriting goes through the same rename
    assert sorted(os.listdir(tmp_path)) == ["store.npz"]

    expected = dict(meta, num_layers=L, num_experts=J, embed_dim=H, prefetch_distance=np.int64(2))
    loaded = ExpertMapStore.load(path, expected)
    assert len(loaded) == 10 and loaded.capacity == 16
    np.testing.assert_array_equal(loaded.maps, store.maps)
    np.testing.assert_array_equal(loaded.embeds, store.embeds)
    for a, b in zip(loaded.match_embed(embeds[:3]), store.match_embed(embeds[:3]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert ExpertMapStore.load(path, expected, capacity=40).capacity == 40
    with pytest.raises(ValueError, match="capacity >= 10"):
        ExpertMapStore.load(path, expected, capacity=5)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "qwen"),
        ("num_layers", L + 1),
        ("num_experts", J * 2),
        ("embed_dim", 8),
        ("prefetch_distance", 3),
    ],
)
def test_load_refuses_another_model(tmp_path, field, value):
    store = _store(prefetch_distance=2)
    store.add(*_data(6, 3))
    path = tmp_path / "store.npz"
    store.save(path, {"model": "tiny-mixtral"})
    expected = dict(model="tiny-mixtral", num_layers=L, num_experts=J, embed_dim=H, prefetch_distance=2)
    expected[field] = value
    with pytest.raises(ValueError, match=rf"{field}: file has .*, expected {value!r}"):
        ExpertMapStore.load(path, expected)


def test_load_needs_the_shape_fields(tmp_path):
    path = tmp_path / "store.npz"
    _store().save(path, {"model": "m"})
    with pytest.raises(ValueError, match="embed_dim"):
        ExpertMapStore.load(path, {"model": "m", "num_layers": L, "num_experts": J, "prefetch_distance": 1})


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "store.npz"
    store = _store()
    store.add(*_data(7, 2))
    store.save(path, {"model": "m"})
    before = path.read_bytes()

    def broken_savez(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    store.add(*_data(8, 2))
    with pytest.raises(OSError, match="disk full"):
        store.save(path, {"model": "m"})
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["store.npz"]


def test_bad_inputs_are_refused():
    store = _store()
    with pytest.raises(ValueError, match="embeds must be"):
        store.add(np.ones((H,), np.float32), np.ones((1, L, J), np.float32))
    with pytest.raises(ValueError, match="one map per embedding"):
        store.add(np.ones((2, H), np.float32), np.ones((1, L, J), np.float32))
    with pytest.raises(ValueError, match="trajs must be"):
        store.match_traj(np.ones((1, L + 1, J), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        store.match_embed(np.full((1, H), np.nan, np.float32))


# Selection (equations 6-8).


def test_full_confidence_selects_exactly_top_k():
    probs = np.array([0.1, 0.4, 0.05, 0.3, 0.15])
    np.testing.assert_array_equal(select_experts(probs, 1.0, top_k=2), [1, 3])
    np.testing.assert_array_equal(select_experts(probs, 1.7, top_k=1), [1])


def test_no_confidence_covers_all_mass_but_not_zero_experts():
    probs = np.array([0.2, 0.0, 0.5, 0.0, 0.3])
    np.testing.assert_array_equal(select_experts(probs, 0.0, top_k=1), [2, 4, 0])
    # Negative similarity: delta = 1 - score > 1 is clipped to 1, the same set.
    np.testing.assert_array_equal(select_experts(probs, -0.8, top_k=1), [2, 4, 0])


def test_partial_confidence_takes_the_smallest_prefix_reaching_delta():
    probs = np.array([0.5, 0.3, 0.2])
    # delta = 0.6: 0.5 alone falls short, 0.5 + 0.3 reaches it.
    np.testing.assert_array_equal(select_experts(probs, 0.4, top_k=1), [0, 1])
    # delta = 0.5: the first expert reaches it exactly.
    np.testing.assert_array_equal(select_experts(probs, 0.5, top_k=1), [0])
    # top_k wins over a smaller delta set.
    np.testing.assert_array_equal(select_experts(probs, 0.5, top_k=3), [0, 1, 2])


def test_ties_go_to_the_lower_expert_id():
    np.testing.assert_array_equal(select_experts(np.full(4, 0.25), 0.5, top_k=1), [0, 1])
    np.testing.assert_array_equal(select_experts(np.array([0.1, 0.45, 0.45]), 1.0, top_k=1), [1])


def test_rows_take_their_own_scores():
    probs = np.array([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0], [0.0, 0.0, 0.0]])
    ids = select_experts(probs, np.array([1.0, 0.0, 0.0]), top_k=1)
    assert [i.tolist() for i in ids] == [[0], [0, 1], []]


def test_select_mask_marks_what_select_experts_returns():
    """The policy's loop-free form, on ties, zero rows and per-row scores."""
    rng = np.random.default_rng(0)
    probs = np.round(rng.dirichlet(np.ones(8), size=40), 1)  # rounded: many ties
    probs[5] = 0.0
    scores = rng.uniform(-1.0, 1.0, 40)
    for top_k in (1, 2, 8):
        mask = select_mask(probs, scores, top_k)
        for row, ids in enumerate(select_experts(probs, scores, top_k)):
            assert np.flatnonzero(mask[row]).tolist() == sorted(ids.tolist()), (row, top_k)


def test_sorted_maps_select_what_select_mask_selects():
    """The matcher's cached form: any layers of any maps at any scores, the same masks as sorting each time,
    also once its cache has dropped maps and sorts them again."""
    rng = np.random.default_rng(1)
    maps = np.round(rng.dirichlet(np.ones(8), size=(5, 6)), 1).astype(np.float32)  # [B, L, J], many ties
    maps[1, 2] = 0.0  # a layer with no mass selects nothing
    sorted_maps = SortedMaps(capacity=2)
    for _ in range(3):
        for top_k in (1, 2, 8):
            layers = np.sort(rng.choice(6, size=int(rng.integers(1, 7)), replace=False))
            scores = rng.uniform(-1.0, 1.0, 5).astype(np.float32)
            got = sorted_maps.select_mask(maps, layers, scores, top_k)
            rows = maps[:, layers].reshape(-1, 8)
            want = select_mask(rows, np.repeat(scores, len(layers)), top_k).reshape(got.shape)
            np.testing.assert_array_equal(got, want)
            start = int(layers[0])  # the matcher's targets: consecutive layers, as a slice
            span = sorted_maps.select_mask(maps[:1], slice(start, 6), scores[:1], top_k)
            want = select_mask(maps[0, start:], np.repeat(scores[:1], 6 - start), top_k)
            np.testing.assert_array_equal(span[0], want)
    assert len(sorted_maps._sorted) == 2
    # A map not met before, asked for fewer than half its layers (the semantic search's first d): those
    # layers alone are sorted, and the map is not kept.
    fresh = SortedMaps()
    for top_k in (1, 2):
        got = fresh.select_mask(maps[2:3], slice(4, 6), np.array([0.3], np.float32), top_k)
        np.testing.assert_array_equal(got[0], select_mask(maps[2, 4:], np.full(2, 0.3, np.float32), top_k))
    assert not fresh._sorted
    with pytest.raises(ValueError, match="non-negative"):
        sorted_maps.select_mask(-maps, np.arange(6), np.ones(5), 1)
    with pytest.raises(ValueError, match="top_k"):
        sorted_maps.select_mask(maps, np.arange(6), np.ones(5), 9)


def test_sorted_maps_top_sets_are_each_layers_top_k():
    """`top_sets` (what confirms a match, `SearchSkips`): each layer's top k by descending probability, ties
    to the lower id, in ascending ids; the same once its cache has dropped the map and sorts it again."""
    rng = np.random.default_rng(2)
    maps = np.round(rng.dirichlet(np.ones(8), size=(4, 6)), 1).astype(np.float32)  # [B, L, J], many ties
    sorted_maps = SortedMaps(capacity=2)
    for _ in range(2):
        for expert_map in maps:
            for top_k in (1, 3):
                want = np.sort(np.argsort(-expert_map, axis=1, kind="stable")[:, :top_k], axis=1).tolist()
                assert sorted_maps.top_sets(expert_map, top_k) == want
    assert len(sorted_maps._tops) == 2


def test_descending_order_is_the_stable_argsort():
    """The packed-key sort orders float32 rows as `np.argsort(-rows, kind="stable")` does: ties (many), zeros,
    -0.0, subnormals and 1.0, in rows as narrow as Mixtral's and as wide as Qwen3's and wider."""
    rng = np.random.default_rng(3)
    for width in (1, 2, 8, 60, 128, 300):
        rows = rng.random((40, width), dtype=np.float32)
        rows[:10] = np.round(rows[:10] * 3) / 3  # few distinct values: ties everywhere
        rows[10, :] = 0.0
        rows[11, ::2] = -0.0
        rows[12, ::3] = np.float32(1e-45)  # the smallest subnormal
        rows[13, ::2] = 1.0
        np.testing.assert_array_equal(descending_order(rows), np.argsort(-rows, axis=1, kind="stable"))
        wide = rows.astype(np.float64)  # other dtypes sort the stable way itself
        np.testing.assert_array_equal(descending_order(wide), np.argsort(-wide, axis=1, kind="stable"))


def test_selection_refuses_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        select_experts(np.full(4, 0.25), 0.5, top_k=5)
    with pytest.raises(ValueError, match="non-negative"):
        select_experts(np.array([0.5, -0.1, 0.6]), 0.5, top_k=1)
    with pytest.raises(ValueError, match="finite"):
        select_experts(np.full(4, 0.25), np.nan, top_k=1)


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(0, 20), min_size=1, max_size=12).filter(any),
    score=st.floats(-1.0, 1.0),
    top_k=st.integers(1, 12),
)
def test_selected_set_is_the_smallest_reaching_delta(weights, score, top_k):
    probs = np.array(weights, np.float64) / sum(weights)
    top_k = min(top_k, len(probs))
    delta = min(max(1.0 - score, 0.0), 1.0)
    ids = select_experts(probs, score, top_k=top_k)
    assert len(set(ids.tolist())) == len(ids) >= top_k
    assert probs[ids].sum() >= delta - MASS_TOLERANCE
    # Every selected expert is at least as likely as every unselected one.
    rest = np.setdiff1d(np.arange(len(probs)), ids)
    if rest.size:
        assert probs[ids].min() >= probs[rest].max()
    # Minimal: one fewer expert would miss delta, unless top_k forces the size.
    if len(ids) > top_k:
        assert probs[ids[:-1]].sum() < delta - MASS_TOLERANCE


# Priorities (section 4.5).


def test_prefetch_priority_prefers_likely_and_near_experts():
    pri = prefetch_priority(np.array([0.6, 0.6, 0.2]), np.array([3, 5, 3]), current_layer=2)
    np.testing.assert_allclose(pri, [0.6, 0.2, 0.2], rtol=1e-12, atol=0)
    assert prefetch_priority(0.9, 4, 0) > prefetch_priority(0.3, 4, 0)


@pytest.mark.parametrize("layer", [2, 1])
def test_prefetch_priority_refuses_layers_not_ahead(layer):
    with pytest.raises(ValueError, match="current_layer=2"):
        prefetch_priority(0.5, layer, current_layer=2)


def test_keep_priority_evicts_lowest_p_times_visits_first():
    p = np.array([0.5, 0.1, 0.9, 0.0, 0.4])
    uses = np.array([3.0, 9.0, 0.0, 7.0, 1.0])
    keep = keep_priority(p, uses)  # p * (uses + 1): the arrival counts as a visit
    np.testing.assert_allclose(keep, [2.0, 1.0, 0.9, 0.0, 0.8], rtol=1e-12, atol=0)
    # Lowest first: p = 0 whatever its uses, then 0.8, then the fresh prefetch of p = 0.9, 1.0, 2.0.
    np.testing.assert_array_equal(np.argsort(keep, kind="stable"), [3, 4, 2, 1, 0])
    with pytest.raises(ValueError, match=">= 0"):
        keep_priority(-0.1, 1.0)


def test_future_of_averages_the_followers_of_the_most_similar_maps():
    """The reuse hint: the followers of the best-matching stored map (one neighbour), or of the `neighbours`
    best weighted by cosine similarity; maps without followers are never chosen; zeros while none has any."""
    embeds, maps = _data(0, 6)
    store = _store(capacity=6)
    slots = store.add(embeds, maps)
    query = maps[:1]
    np.testing.assert_array_equal(store.future_of(query, 3), np.zeros_like(query))
    _, followers = _data(1, 6)
    with_followers = slots[1:]  # the query's own map (slot of row 0) has none
    store.add_future(with_followers, followers[1:])
    store.add_future(with_followers[:1], followers[:1])  # slot of row 1: the mean of two followers
    means = {int(s): f for s, f in zip(with_followers, followers[1:], strict=True)}
    means[int(with_followers[0])] = (followers[1] + followers[0]) / 2

    sims = _cos(query.reshape(1, -1), maps[1:].reshape(5, -1))[0]  # rows 1..5, float64
    order = np.argsort(-sims)
    np.testing.assert_allclose(store.future_of(query)[0], means[int(with_followers[order[0]])], atol=1e-6)
    top = order[:3]
    weights = sims[top] / sims[top].sum()
    expected = sum(w * means[int(with_followers[i])] for w, i in zip(weights, top, strict=True))
    np.testing.assert_allclose(store.future_of(query, 3)[0], expected, atol=1e-5)
    # More neighbours than maps with followers: all five, by similarity.
    expected = sum(w * means[int(s)] for w, s in zip(sims / sims.sum(), with_followers, strict=True))
    np.testing.assert_allclose(store.future_of(query, 50)[0], expected, atol=1e-5)
    with pytest.raises(ValueError, match="neighbours must be >= 1"):
        store.future_of(query, 0)


def test_future_of_the_map_just_added_reuses_its_cosines_and_answers_the_same():
    """Decode adds one map to a full store and asks what follows it: `future_of` takes the cosines `add`
    computed for its redundancy rule instead of a second pass over the store, with the same answer (to
    float32 rounding) as a store that computes them afresh; any other map, or a later write, is searched."""
    embeds, maps = _data(0, 12)
    _, followers = _data(1, 12)
    stores = [_store(capacity=8) for _ in range(2)]
    for store in stores:
        slots = store.add(embeds[:8], maps[:8])
        store.add_future(slots, followers[:8])
    new_embed, new_map = _data(2, 1)
    fresh, reusing = stores
    fresh.add(new_embed, new_map)
    fresh._added = None  # forget the cosines: a second pass over the store
    reusing.add(new_embed, new_map)
    assert reusing._added is not None and reusing._added[0] == reusing.version
    for neighbours in (1, 3, 8):
        np.testing.assert_allclose(
            reusing.future_of(new_map, neighbours), fresh.future_of(new_map, neighbours), atol=1e-6
        )
    calls = []
    original = store_module._scores
    try:
        store_module._scores = lambda *a: calls.append(1) or original(*a)
        reusing.future_of(new_map, 3)
        assert not calls  # the map just added: no pass over the store
        reusing.future_of(maps[:1], 3)
        assert calls  # another map is searched
        for store in stores:
            store.add(*_data(3, 2))  # a later write (two rows: nothing stashed)
        calls.clear()
        hint = reusing.future_of(new_map, 3)
        assert calls  # the cosines of `new_map` are stale: searched
        np.testing.assert_allclose(hint, fresh.future_of(new_map, 3), atol=1e-6)
    finally:
        store_module._scores = original


@pytest.mark.parametrize("mode", SEARCH_MODES, ids=["exact", "sketch"])
def test_add_after_match_embed_reuses_its_scores_and_stores_the_same(mode):
    """Decode searches an embedding (`match_embed`) and stores it with its map at the iteration's end: `add`
    then takes the embedding's norm, sketch and semantic scores from that search instead of a pass of its
    own over the stored embeddings, and the store ends bit-identical to one that never searched; a write in
    between, or another embedding, is scored afresh."""
    rng = np.random.default_rng(5)
    searching, plain = (_store(capacity=10, prefetch_distance=2, **mode) for _ in range(2))
    for store in (searching, plain):
        store.add(*_data(0, 10))  # full: every later add replaces the most redundant map
    calls = []
    original = store_module._scores
    try:
        store_module._scores = lambda *a: calls.append(a[0].shape) or original(*a)
        for step in range(40):
            embed, expert_map = _data(100 + step, 1)
            if step % 3 == 0:  # a repeated context: the search finds it, the add replaces near it
                embed = embed + searching.embeds[rng.integers(10)]
            searching.match_embed(embed)
            if step % 5 == 4:  # a write between the search and the add: its scores are stale
                other = _data(500 + step, 1)
                searching.add(*other)
                plain.add(*other)
            if step % 7 == 6:  # another embedding stored than searched
                embed = embed + 1.0
            calls.clear()
            slots = searching.add(embed, expert_map)
            reused = not any(shape[1] in (H, searching.sketch_dim) for shape in calls)
            assert reused == (step % 5 != 4 and step % 7 != 6)
            np.testing.assert_array_equal(slots, plain.add(embed, expert_map))
    finally:
        store_module._scores = original
    for name in ("_embeds", "_maps", "_inv_embed_norm", "_inv_prefix_norm"):
        np.testing.assert_array_equal(getattr(searching, name), getattr(plain, name))


def test_add_future_counts_a_slot_named_twice_twice():
    """Followers of the same slot in one call add up, as one call per follower would (a request's recent
    tokens can share a slot when a later one replaced the map of an earlier); distinct slots add once."""
    embeds, maps = _data(0, 4)
    once, twice = _store(capacity=4), _store(capacity=4)
    for store in (once, twice):
        store.add(embeds, maps)
    _, followers = _data(1, 3)
    twice.add_future(np.array([2, 0, 2]), followers)
    for slot, follower in zip((2, 0, 2), followers, strict=True):
        once.add_future(np.array([slot]), follower[None])
    np.testing.assert_array_equal(twice._future, once._future)
    np.testing.assert_array_equal(twice._future_count, [1.0, 0.0, 2.0, 0.0])
    np.testing.assert_allclose(
        twice.future_of(maps[2:3]), ((followers[0] + followers[2]) / 2)[None], atol=1e-6
    )
