"""fMoE's Expert Map Store: stored expert maps, their semantic and trajectory search, deduplication.

Owned by the fmoe policy's matcher (`offload/policies/fmoe/`); pure NumPy. Its files: `store_file.py`.

Paper sections 4.1, 4.2 and 4.4. An expert map is the router probabilities of every layer for one
token at one iteration, [L, J]; its semantic context is that token's input embedding, [H].

Shapes: C capacity, n = len(store) <= C, B rows of a batch, H embedding size, L layers, J experts per
layer, l observed layers of a trajectory, k sketch size, R rerank candidates.

Layout, chosen so that one match is one matrix-vector product over contiguous float32 memory:
  embeddings [C, H] and maps [C, L*J] (row-major, so the first l layers of every map are the first
  l*J columns: a prefix is a strided view, never a copy); inverse norms of the embeddings [C] and of
  every map prefix [L, C] (row l-1 is 1/||map[:l*J]||, from a cumulative sum over layers), written
  once per stored map, so a match never recomputes a norm.

An exact semantic search reads all n*H floats per query, memory-bound
(decision "sketched semantic search"). Above `rerank` stored maps the search therefore
shortlists the R best candidates on a k-dimensional sketch of the unit embeddings, [C, k], and
rescores those R exactly: the reported score is always the exact cosine of the returned map, and
the returned map is the exact best unless R stored maps beat it on the sketch. The sketch is a count
sketch (the H coordinates, randomly signed, summed in k random groups of equal size): it preserves
inner products in expectation like a Gaussian Johnson-Lindenstrauss projection, but costs no [H, k]
matrix read per query. `sketch_dim=None` turns it off. The trajectory search is always exact.

Not thread-safe: one thread (the policy's) adds and matches.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from . import store_file

if TYPE_CHECKING:
    from .prefix_dots import PrefixDots

# Defaults, chosen for the host time of a decode iteration at real shapes against the simulated TPOT on the
# validation split: decision "store capacity".
CAPACITY = 512
RERANK = 64
# `add`'s rerank rescores this many of the shortlist first (`_most_redundant`): a multiple of 8 rows, which
# the BLAS kernels here compute row by row exactly as in a product over the whole shortlist.
FIRST_RERANKED = 16
# Above any cosine computed in float32 (its rounding can pass 1 by a few ulp): the rerank's bound.
_COSINE_CEILING = 1.001

# Norms below this are treated as zero: such a vector has cosine 0 with everything.
_NORM_FLOOR = 1e-12
_SKETCH_SEED = 0


class ExpertMapStore:
    """At most `capacity` expert maps with their semantic embeddings, searched by cosine similarity.

    While not full, `add` appends. When full, each new map replaces the stored map that is most
    redundant with it (section 4.4):

        RDY = (d / L) * cos(embedding_new, embedding_old) + (1 - d / L) * cos(map_new, map_old),

    with d the prefetch distance and both maps flattened to [L*J].

    Matching an empty store returns scores 0 and all-zero maps (no stored map, no information);
    `select.select_experts` selects no expert from an all-zero map.
    """

    def __init__(
        self,
        *,
        capacity: int = CAPACITY,
        num_layers: int,
        num_experts: int,
        embed_dim: int,
        prefetch_distance: int,
        sketch_dim: int | None = 256,
        rerank: int = RERANK,
    ):
        for name, value in (
            ("capacity", capacity),
            ("num_layers", num_layers),
            ("num_experts", num_experts),
            ("embed_dim", embed_dim),
            ("rerank", rerank),
        ):
            if value < 1:
                raise ValueError(f"ExpertMapStore {name} must be >= 1, got {value}.")
        if not 0 <= prefetch_distance <= num_layers:
            raise ValueError(
                f"prefetch_distance must be in [0, num_layers={num_layers}], got {prefetch_distance}."
            )
        if sketch_dim is not None and sketch_dim < 1:
            raise ValueError(f"sketch_dim must be >= 1 or None (exact search), got {sketch_dim}.")
        self.capacity = capacity
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.embed_dim = embed_dim
        self.prefetch_distance = prefetch_distance
        self.rerank = rerank
        # Weight of the semantic similarity in the redundancy score (section 4.4).
        self.semantic_weight = prefetch_distance / num_layers
        width = num_layers * num_experts

        self._size = 0
        # (version, [1, L*J] map, [1, C] cosines with every stored map): the last single map `add` stored
        # into a full store, with the cosines its redundancy rule computed, until the next write.
        self._added: tuple[int, np.ndarray, np.ndarray] | None = None
        # (version, [B, H] embeddings, their inverse norms [B], sketch [B, k], semantic scores [B, n]): the
        # last `match_embed`, until the next write. fmoe's decode map update (`add`) stores the embedding
        # its iteration's semantic search has just scored against the same maps, and reuses the lot.
        self._matched_embeds: tuple[int, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray] | None = None
        self.version = 0  # counts writes of maps (a `PrefixDots` started before one starts over)
        # Arrays a policy keeps beside the maps (fmoe's calibration tables), saved and loaded with them.
        self.attachments: dict[str, np.ndarray] = {}
        self._embeds = np.zeros((capacity, embed_dim), np.float32)  # [C, H]
        self._inv_embed_norm = np.zeros((capacity,), np.float32)  # [C]
        self._maps = np.zeros((capacity, width), np.float32)  # [C, L*J]
        # The same maps layer by layer, for the trajectory searches of an iteration (`PrefixDots`): each
        # adds one layer's products, and reading that layer of every map from the [C, L*J] rows takes a
        # short piece of each row (a cache miss or more per map), from [L, C, J] one contiguous block
        # (decision "store layout by layer").
        self._by_layer = np.zeros((num_layers, capacity, num_experts), np.float32)  # [L, C, J]
        # What followed each map in its request: the sum of the next tokens' maps, and how many were added
        # (`add_future`); `future_of` answers with the mean followers of the best-matching maps.
        self._future = np.zeros((capacity, width), np.float32)  # [C, L*J]
        self._future_count = np.zeros((capacity,), np.float32)  # [C]
        self._inv_prefix_norm = np.zeros((num_layers, capacity), np.float32)  # [L, C]
        # A sketch only pays off when it is smaller than the embedding and the store can outgrow
        # the rerank shortlist; otherwise every search is exact.
        self.sketch_dim = sketch_dim if sketch_dim is not None and sketch_dim < embed_dim else None
        if self.sketch_dim is not None and capacity > rerank:
            rng = np.random.default_rng(_SKETCH_SEED)
            self._sketch_order = rng.permutation(embed_dim)  # [H]: coordinate order, group by group
            self._sketch_sign = rng.choice(np.array([-1.0, 1.0], np.float32), embed_dim)  # [H]
            self._sketch_starts = np.arange(self.sketch_dim) * embed_dim // self.sketch_dim  # [k]
            self._sketch = np.zeros((capacity, self.sketch_dim), np.float32)  # [C, k], unit rows
        else:
            self.sketch_dim = None
            self._sketch = None

    def __len__(self) -> int:
        return self._size

    @property
    def embeds(self) -> np.ndarray:  # [n, H]
        """Stored semantic embeddings, a read-only view."""
        return _read_only(self._embeds[: self._size])

    @property
    def maps(self) -> np.ndarray:  # [n, L, J]
        """Stored expert maps, a read-only view."""
        return _read_only(self._maps[: self._size].reshape(self._size, self.num_layers, self.num_experts))

    @property
    def nbytes(self) -> int:
        """Bytes held by the store's arrays (preallocated for the full capacity)."""
        arrays = [self._embeds, self._inv_embed_norm, self._maps, self._by_layer, self._inv_prefix_norm]
        arrays += [self._future, self._future_count]
        if self._sketch is not None:
            arrays += [self._sketch, self._sketch_order, self._sketch_sign, self._sketch_starts]
        return sum(a.nbytes for a in arrays)

    def add(
        self,
        embeds: np.ndarray,  # [B, H]
        maps: np.ndarray,  # [B, L, J]
        dots: np.ndarray | None = None,  # [B, n] maps . stored maps, from `PrefixDots.full_dots`
    ) -> np.ndarray:  # [B] int64
        """Stores B new expert maps; returns the slot each one went to.

        A batch behaves exactly like B single-row calls in row order: rows append while there is
        room; once full, each row replaces the stored map most redundant with it, where the store
        already holds the earlier rows of the batch. So two new rows replace the same slot only when
        the second is most redundant with the first (the first is then dropped as a near-duplicate),
        and no old map is dropped for a row that was itself dropped. Ties go to the lowest slot.

        The authors' code (`ExpertMapStore.add` in finemoe/runtime/model_offload.py) instead takes
        every row's argmax against the store as it was before the replacements and scatters the
        rows: rows sharing an argmax overwrite each other there, so fewer old maps are replaced than
        rows arrived and some rows are lost without being compared with each other.

        One matrix product scores all B rows against the store; the sequential replacement then
        updates only the replaced columns, from the batch's own [B, B] similarities. `dots`, the rows' dot
        products with every stored map already summed (a full store's), replace that product's map half.
        """
        embeds, flat = self._new_rows(embeds, maps)  # [B, H], [B, L*J]
        inv_prefix = self._prefix_stats(flat)
        scored = self._matched_embeds  # the same rows' `match_embed` against the same maps, if it was last
        if scored is not None and scored[0] == self.version and np.array_equal(scored[1], embeds):
            inv_embed, sketch, scored_sem = scored[2], scored[3], scored[4]
        else:
            (inv_embed, sketch), scored_sem = self._embed_stats(embeds), None
        num_rows = embeds.shape[0]
        slots = np.empty((num_rows,), np.int64)

        take = min(self.capacity - self._size, num_rows)
        if take:  # free slots first
            slots[:take] = np.arange(self._size, self._size + take)
            rows = slice(0, take)
            self._write(slots[rows], rows, embeds, flat, inv_embed, inv_prefix, sketch)
            self._size += take
        if take == num_rows:
            return slots

        # Full from here on: n == C.
        rest = slice(take, num_rows)
        unit_embeds = embeds[rest] * inv_embed[rest, None]  # [r, H]
        sem, traj, sem_batch, traj_batch = self._redundancy(
            unit_embeds,
            flat[rest] * inv_prefix[rest, -1:],
            None if sketch is None else sketch[rest],
            inv_prefix[rest, -1:],
            scored_sem if take == 0 else None,  # the same product of the same rows and stored embeddings
            dots if take == 0 else None,
        )
        w = self.semantic_weight
        for i, row in enumerate(range(take, num_rows)):
            rdy = w * sem[i] + (1.0 - w) * traj[i]  # [C]
            if self._sketch is None:
                slot = int(np.argmax(rdy))
            else:
                # sem holds sketch estimates: shortlist on them, decide on exact cosines.
                cand = _top_candidates(rdy, self.rerank)  # [R]
                slot = self._most_redundant(cand, unit_embeds[i], traj[i, cand])
            slots[row] = slot
            one = slice(row, row + 1)
            self._write(slots[one], one, embeds, flat, inv_embed, inv_prefix, sketch)
            if i + 1 < len(sem):  # the later rows' cosines with the map now in `slot`
                sem[i + 1 :, slot], traj[i + 1 :, slot] = sem_batch[i + 1 :, i], traj_batch[i + 1 :, i]
        if num_rows == 1:  # decode: `future_of` the same map next (fmoe's reuse hint) reuses its cosines
            traj[0, slot] = traj_batch[0, 0]
            self._added = (self.version, flat.copy(), traj)
        return slots

    def _new_rows(self, embeds: np.ndarray, maps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`add`'s rows checked: embeddings `[B, H]` and maps flattened `[B, L*J]`, float32."""
        embeds = self._rows(embeds, (self.embed_dim,), "embeds")  # [B, H]
        maps = self._rows(maps, (self.num_layers, self.num_experts), "maps")  # [B, L, J]
        if embeds.shape[0] != maps.shape[0]:
            raise ValueError(
                f"add needs one map per embedding, got {embeds.shape[0]} embeddings and {maps.shape[0]} maps."
            )
        if maps.size and maps.min() < 0:  # finite, as `_rows` has checked
            raise ValueError("expert maps hold router probabilities and must be >= 0.")
        return embeds, maps.reshape(len(maps), self.num_layers * self.num_experts)

    def _redundancy(
        self,
        unit_embeds: np.ndarray,  # [r, H]
        unit_maps: np.ndarray,  # [r, L*J]
        sketch: np.ndarray | None,  # [r, k]
        inv_norm: np.ndarray,  # [r, 1] the maps' inverse norms
        scored_sem: np.ndarray | None,  # [r, C] the rows' `match_embed` scores against this store
        dots: np.ndarray | None,  # [r, C] the maps' dot products with the stored maps
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:  # [r, C], [r, C], [r, r], [r, r]
        """The new rows' semantic and map cosines with every stored map (of a full store) and with each
        other, for `add`'s redundancy rule; scores already computed are taken as given."""
        single = len(unit_embeds) == 1  # `add` writes no score of a single row's, reads no [r, r] cosine
        if scored_sem is not None:
            sem = scored_sem if single else scored_sem.copy()
        elif unit_embeds.any():
            sem = self._semantic_scores(unit_embeds, sketch)
        else:  # zero embeddings (fmoe without semantic search): every cosine is 0, no pass over the store
            sem = np.zeros((len(unit_embeds), self._size), np.float32)
        if dots is not None and np.shape(dots) == (len(unit_maps), self.capacity):
            traj = dots * inv_norm * self._inv_prefix_norm[-1]  # cosines
        else:
            traj = _scores(self._maps, unit_maps) * self._inv_prefix_norm[-1]
        # Replaced columns take the same kind of value as the rest of `sem` (sketch or exact), so a
        # batch shortlists exactly as the equivalent single-row calls would.
        sem_batch = None if single else unit_embeds @ unit_embeds.T if sketch is None else sketch @ sketch.T
        traj_batch = unit_maps @ unit_maps.T
        return sem, traj, sem_batch, traj_batch

    def add_future(self, slots: np.ndarray, maps: np.ndarray) -> None:
        """Records that maps `[B, L, J]` (or one map `[1, L, J]`, for every slot) followed the maps stored at
        `slots` `[B]` in their requests (a slot reused since holds another map: the caller passes slots it has
        just been given)."""
        slots = np.asarray(slots, np.int64)
        flat = self._rows(maps, (self.num_layers, self.num_experts), "maps")
        if len(flat) not in (1, len(slots)):
            raise ValueError(f"add_future needs one map or one a slot ({len(slots)}), got {len(flat)} maps.")
        flat = flat.reshape(len(flat), -1)
        if len(set(slots.tolist())) == len(slots):  # distinct slots (decode, mostly): one add each
            self._future[slots] += flat
            self._future_count[slots] += 1.0
        else:
            np.add.at(self._future, slots, flat)
            np.add.at(self._future_count, slots, 1.0)

    def future_of(self, maps: np.ndarray, neighbours: int = 1) -> np.ndarray:  # [B, L, J] -> [B, L, J]
        """What followed the stored maps most like each of `maps` (cosine over whole maps, among maps with
        followers): the mean of each one's followers, averaged over the `neighbours` most similar weighted by
        their similarity (equal weights when every similarity is 0); zeros when no map has a follower."""
        if neighbours < 1:
            raise ValueError(f"neighbours must be >= 1, got {neighbours}")
        maps = self._rows(maps, (self.num_layers, self.num_experts), "maps")
        n = self._size
        has = np.flatnonzero(self._future_count[:n] > 0)  # the maps with followers
        if not has.size:
            return np.zeros(maps.shape, np.float32)
        flat = maps.reshape(len(maps), -1)
        added = self._added
        if added is not None and added[0] == self.version and np.array_equal(added[1], flat):
            sims = added[2]  # the map `add` has just stored: the cosines it computed
        else:
            sims = _scores(self._maps[:n], flat * _inv_norm(flat)[:, None]) * self._inv_prefix_norm[-1, :n]
        # Once every stored map has followers (a store in use, mostly), slots are columns: no index copies.
        sims = sims[:, :n] if has.size == n else sims[:, has]  # [B, m]
        k = min(neighbours, has.size)
        if k == 1:
            best = has[np.argmax(sims, axis=1)]  # [B]
            return (self._future[best] / self._future_count[best, None]).reshape(maps.shape)
        top = np.argpartition(-sims, k - 1, axis=1)[:, :k]  # [B, k]
        weights = np.maximum(sims[np.arange(len(sims))[:, None], top], 0.0)  # maps are >= 0: so are cosines
        total = weights.sum(axis=1, keepdims=True)
        weights = np.where(positive := total > 0, weights / np.where(positive, total, 1.0), 1.0 / k)
        slots = top if has.size == n else has[top]  # [B, k]
        followers = self._future[slots] / self._future_count[slots][..., None]  # [B, k, L*J]
        return np.einsum("bk,bkf->bf", weights, followers).astype(np.float32, copy=False).reshape(maps.shape)

    def match_embed(
        self,
        embeds: np.ndarray,  # [B, H]
    ) -> tuple[np.ndarray, np.ndarray]:  # [B] float32, [B, L, J] float32
        """Semantic search (equation 4): for each row, the stored map whose embedding is most similar.

        Returns the cosine similarity of the best match and a copy of its full map. The policy uses
        the first d layers of it. Empty store: scores 0 and zero maps.
        """
        embeds = self._rows(embeds, (self.embed_dim,), "embeds")  # [B, H]
        if self._size == 0:
            return self._empty_match(embeds.shape[0])
        inv_embed, sketch = self._embed_stats(embeds)
        unit = embeds * inv_embed[:, None]  # [B, H]
        sims = self._semantic_scores(unit, sketch)  # [B, n]
        self._matched_embeds = (self.version, embeds.copy(), inv_embed, sketch, sims)
        if self._sketch is None or self._size <= self.rerank:
            best = np.argmax(sims, axis=1)  # [B]
            return self._answer(sims[np.arange(len(best)), best], best)
        best = np.empty((embeds.shape[0],), np.int64)
        scores = np.empty((embeds.shape[0],), np.float32)
        for b in range(embeds.shape[0]):
            cand = _top_candidates(sims[b], self.rerank)  # [R]
            exact = self._exact(cand, unit[b])  # [R]
            i = int(np.argmax(exact))
            best[b], scores[b] = cand[i], exact[i]
        return self._answer(scores, best)

    def match_traj(
        self,
        trajs: np.ndarray,  # [B, l, J]
        running: PrefixDots | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:  # [B] float32, [B, L, J] float32
        """Trajectory search (equation 5): the stored map whose first l layers best match `trajs`.

        `trajs` is the router probabilities observed so far in this iteration, layers 0..l-1
        (1 <= l <= L). Returns the cosine similarity of the flattened prefixes and a copy of the full
        best map, from which the policy reads the layers d and more ahead of layer l-1. Empty store:
        scores 0 and zero maps.

        `running`: a `PrefixDots` kept across the searches of one iteration (layer after layer), so that
        each search adds only the layers new since the last (n x J multiply-adds a layer, not n x l x J).
        """
        shape = np.shape(trajs)
        if len(shape) != 3 or not 1 <= shape[1] <= self.num_layers or shape[2] != self.num_experts:
            raise ValueError(
                f"trajs must be [B, l, J={self.num_experts}] with 1 <= l <= L={self.num_layers}, "
                f"got shape {shape}."
            )
        if self._size == 0:
            self._rows(trajs, shape[1:], "trajs")
            return self._empty_match(shape[0])
        if running is not None:
            return running.search(self, np.asarray(trajs))
        trajs = self._rows(trajs, shape[1:], "trajs")  # [B, l, J]
        observed = trajs.shape[1]
        query = trajs.reshape(trajs.shape[0], -1)  # [B, l*J]
        inv_query = _inv_norm(query)  # [B]
        prefix = self._maps[: self._size, : query.shape[1]]  # [n, l*J], strided view
        dots = _scores(prefix, query)
        sims = dots * self._inv_prefix_norm[observed - 1, : self._size] * inv_query[:, None]
        best = np.argmax(sims, axis=1)  # [B]
        return self._answer(sims[np.arange(len(best)), best], best)

    def save(self, path: str | os.PathLike, meta: dict[str, Any]) -> None:
        """Writes the stored maps to one .npz with a JSON header, atomically (`store_file.save`)."""
        store_file.save(self, path, meta)

    @staticmethod
    def check_writable(path: str | os.PathLike) -> None:
        """Refuses, before any serving, a store path that `save` could not write at the end."""
        store_file.check_writable(path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        expected_meta: dict[str, Any],
        *,
        capacity: int | None = None,
        sketch_dim: int | None = 256,
        rerank: int = RERANK,
    ) -> ExpertMapStore:
        """Reads a store written by `save`, refusing one built for another model (`store_file.load`)."""
        return store_file.load(
            cls, path, expected_meta, capacity=capacity, sketch_dim=sketch_dim, rerank=rerank
        )

    def _rows(self, x: np.ndarray, trailing: tuple[int, ...], name: str) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 1 + len(trailing) or x.shape[1:] != tuple(trailing):
            dims = ", ".join(str(d) for d in trailing)
            raise ValueError(f"{name} must be [B, {dims}] (add a batch axis for one row), got {x.shape}.")
        if not math.isfinite(float(x.sum())) and not np.isfinite(x).all():  # NaN or inf make the sum so
            raise ValueError(f"{name} holds NaN or inf; the store only takes finite values.")
        return x

    def _embed_stats(
        self,
        embeds: np.ndarray,  # [B, H]
    ) -> tuple[np.ndarray, np.ndarray | None]:  # [B], [B, k]
        """Inverse norms of new embeddings and their unit sketch (None without a sketch)."""
        inv_embed = _inv_norm(embeds)
        sketch = None
        if self._sketch is not None:
            signed = embeds[:, self._sketch_order] * (self._sketch_sign * inv_embed[:, None])  # [B, H]
            sketch = np.add.reduceat(signed, self._sketch_starts, axis=1)  # [B, k]
            sketch *= _inv_norm(sketch)[:, None]
        return inv_embed, sketch

    def _prefix_stats(self, flat_maps: np.ndarray) -> np.ndarray:  # [B, L*J] -> [B, L]
        """Inverse norms of every prefix of new maps (layers 0..l, for each l)."""
        per_layer = flat_maps.reshape(-1, self.num_layers, self.num_experts).astype(np.float64)
        prefix_norm = np.sqrt(np.cumsum(np.einsum("blj,blj->bl", per_layer, per_layer), axis=1))
        return (1.0 / np.maximum(prefix_norm, _NORM_FLOOR)).astype(np.float32)

    def _write(
        self,
        slots: np.ndarray,  # [m]
        rows: slice,  # the m rows of the batch that go there
        embeds: np.ndarray,  # [B, H]
        flat_maps: np.ndarray,  # [B, L*J]
        inv_embed: np.ndarray,  # [B]
        inv_prefix: np.ndarray,  # [B, L]
        sketch: np.ndarray | None,  # [B, k]
    ) -> None:
        self.version += 1
        if len(slots) == 1:  # one row (decode): basic indexing, no fancy-index temporaries
            slots, rows = int(slots[0]), rows.start
        maps = flat_maps[rows]  # [m, L*J] ([L*J] for one row)
        self._embeds[slots] = embeds[rows]
        self._inv_embed_norm[slots] = inv_embed[rows]
        self._maps[slots] = maps
        by_layer = maps.reshape(-1, self.num_layers, self.num_experts).swapaxes(0, 1)  # [L, m, J]
        self._by_layer[:, slots] = by_layer[:, 0] if isinstance(slots, int) else by_layer
        self._future[slots] = 0.0
        self._future_count[slots] = 0.0
        self._inv_prefix_norm[:, slots] = inv_prefix[rows].T
        if self._sketch is not None:
            self._sketch[slots] = sketch[rows]

    def _semantic_scores(
        self,
        unit_embeds: np.ndarray,  # [B, H], unit rows
        sketch: np.ndarray | None,  # [B, k], unit rows
    ) -> np.ndarray:  # [B, n]
        """Cosines with the stored embeddings; sketch estimates when the store is large enough."""
        n = self._size
        if self._sketch is None or n <= self.rerank:
            return _scores(self._embeds[:n], unit_embeds) * self._inv_embed_norm[:n]
        return _scores(self._sketch[:n], sketch)

    def _most_redundant(self, cand: np.ndarray, unit: np.ndarray, traj: np.ndarray) -> int:  # [R], [H], [R]
        """`add`'s rerank: the slot in `cand` with the highest `w * exact cosine + (1 - w) * traj` (ties: the
        lowest). A cosine is at most 1, so the `FIRST_RERANKED` candidates with the highest bound are rescored
        first, and where the best of them beats every other's bound the others' embeddings are not read (the
        map cosine decides most adds, w being d / L). The same slot as rescoring all of them."""
        w = self.semantic_weight
        if len(cand) > FIRST_RERANKED and unit.any():
            bound = w * np.float32(_COSINE_CEILING) + (1.0 - w) * traj  # >= each candidate's score
            first = np.sort(np.argpartition(-bound, FIRST_RERANKED - 1)[:FIRST_RERANKED])
            score = w * self._exact(cand[first], unit) + (1.0 - w) * traj[first]
            best = int(np.argmax(score))
            others = np.ones(len(cand), bool)
            others[first] = False
            if score[best] > bound[others].max():
                return int(cand[first[best]])
        return int(cand[np.argmax(w * self._exact(cand, unit) + (1.0 - w) * traj)])

    def _exact(self, cand: np.ndarray, unit: np.ndarray) -> np.ndarray:  # [R], [H] -> [R]
        """A sketched search's rerank: cosines of one unit embedding with the stored ones at `cand` (a zero
        embedding, as fmoe without semantic search stores, has cosine 0 with all: no rows gathered)."""
        if not unit.any():
            return np.zeros(len(cand), np.float32)
        return (self._embeds[cand] @ unit) * self._inv_embed_norm[cand]

    def _answer(
        self,
        scores: np.ndarray,  # [B]
        best: np.ndarray,  # [B]
    ) -> tuple[np.ndarray, np.ndarray]:  # [B], [B, L, J]
        # Rounding can put a cosine a few ulp outside [-1, 1]; clip so that delta stays meaningful.
        scores = np.minimum(np.maximum(scores, -1.0), 1.0).astype(np.float32, copy=False)
        return scores, self._maps[best].reshape(len(best), self.num_layers, self.num_experts)

    def _empty_match(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        return (
            np.zeros((batch,), np.float32),
            np.zeros((batch, self.num_layers, self.num_experts), np.float32),
        )


def _scores(
    stored: np.ndarray,  # [n, D], rows may be strided
    queries: np.ndarray,  # [B, D]
) -> np.ndarray:  # [B, n]
    """Dot products of every query with every stored row, as one BLAS call on the stored rows."""
    if len(queries) == 1:
        # One matrix-vector product (gemv) streams the stored rows once.
        return (stored @ queries[0])[None, :]
    return queries @ stored.T


def _inv_norm(rows: np.ndarray) -> np.ndarray:  # [B, D] -> [B] float32
    norm = np.sqrt(np.einsum("bd,bd->b", rows, rows, dtype=np.float64))
    return (1.0 / np.maximum(norm, _NORM_FLOOR)).astype(np.float32)


def _top_candidates(scores: np.ndarray, count: int) -> np.ndarray:  # [n] -> [count] int64, ascending
    """Slots of the `count` highest scores, sorted so that ties resolve to the lowest slot."""
    if count >= len(scores):
        return np.arange(len(scores))
    return np.sort(np.argpartition(-scores, count - 1)[:count])


def _read_only(x: np.ndarray) -> np.ndarray:
    view = x.view()
    view.flags.writeable = False
    return view
