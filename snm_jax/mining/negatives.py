"""The sampler protocol of the train step: how one step's negatives are drawn,
gathered, scored and updated on a (data, model) mesh.

The step (`snm_jax.train.core.step.make_train_step`) is sample -> score -> loss ->
update and knows nothing of how a sampler lays its draws out; each class here
implements the four layout-dependent parts once:

  * `draw_and_gather(table, batch, key)`: the draws (ids, log expected counts
    log_q of the draws and of the positives) and the table rows a model shard
    needs: the drawn rows it scores and the positive rows it owns (zeros where
    another shard owns the label; the positive score is a psum over shards);
  * `local_scores(q, rows, ids, log_q, scorer)`: inside the loss's shard_map,
    the shard's (n, S) scores (`Scorer`), their ids / log_q broadcast to (n, S), which
    of them this shard owns, and a rescorer of chosen columns;
  * `valid_count(valid, ids, label_set)`: how many valid negatives per example
    the shard holds (before the psum over `model`);
  * `rows_to_update(ids, row_grads)`: inside the table update's shard_map, the
    global ids and gradients of the drawn rows this shard applies.

Layouts (N examples, S draws, M model shards, h embedding width):
  SharedNegatives      one set of S ids for the whole minibatch, drawn per
                       stratum on the shard owning it; scores one (n, S/M)
                       matmul per shard. `StratifiedSampler(per_example=False)`.
                       With the full sampler (every label once, in table order:
                       `positives_in_scores`) each positive's score is a column
                       of those scores, so no positive row is gathered, scored
                       or updated apart, and the update is dense.
  PerExampleNegatives  S ids per example, each shard drawing its strata's share:
                       ids (N, S) sharded (data, model), rows (n, S/M, h).
                       `StratifiedSampler(per_example=True)`.
  GlobalNegatives      S ids per example drawn from all labels at once
                       outside the shard_map (the adversarial tree, Bamler &
                       Mandt 2020; `ExactSampler`, Reddi et al.'s Algorithm 1);
                       every shard gathers and scores the draws it owns (zeros
                       elsewhere). Any sampler with a `draw(key, batch)` method
                       (it reads what it needs of the batch: features, labels,
                       label sets, example ids).
Gathered rows are float32 whatever the table's storage dtype (a bfloat16 table, config
table.dtype, held as uint16 bits, is upcast row by row as it is gathered: exact; `precision.upcast`).
`for_sampler` picks the layout of a sampler. A new sampler implements its
draws and, only if no layout fits, one new class here.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from snm_jax.mining.samplers import StratifiedSampler, check_strata_fit_mesh, uniform_log_expected_count
from snm_jax.models import precision
from snm_jax.sharding import BATCH, DATA, MODEL, TABLE

P = jax.P


class Draws(NamedTuple):
  ids: jax.Array        # layout-dependent: (S,) shared, (N, S) per example
  log_q: jax.Array      # same shape: log expected count of each draw among the S draws
  log_q_pos: jax.Array  # (N,): the same for each example's positive
  rows: jax.Array       # gathered drawn rows, `rows_spec`
  pos_rows: jax.Array   # (M, N, h): each shard's rows of the positives it owns, zeros elsewhere
                        # ((M, N, 0) when the layout's `positives_in_scores`)
  owned: jax.Array      # (M, N) bool: which shard owns each positive


class Negatives(Protocol):
  """What `make_train_step` needs from a sampler (see the module docstring)."""
  num_labels: int
  num_samples: int
  table_rows: int
  ids_spec: Any
  rows_spec: Any
  # True: the draws are every row of each shard once, in order (the full sampler); the positives'
  # scores are columns of the local scores (`positive_column`) and their rows are not gathered.
  positives_in_scores: bool

  def draw_and_gather(self, table, batch, key) -> Draws: ...

  def local_scores(self, q_l, rows_l, ids_l, log_q_l, scorer: Scorer): ...

  def valid_count(self, valid, ids_l, label_set_l): ...

  # (n, S) bool: whether each scored id (ids (n, S), local_scores') is in its example's set
  # `excluded` (n, L), padded -1 (`hit_mask`).
  def hits(self, ids, excluded): ...

  def rows_to_update(self, ids_l, row_grads_l): ...


def hit_mask(ids, excluded):
  """(n, S) bool: ids[i, s] in excluded[i] (n, L); -1 padding matches no id. An n x S x L compare."""
  return jnp.any(ids[:, :, None] == excluded[:, None, :], axis=-1)


def range_hit_mask(ids, excluded):
  """`hit_mask` for ids whose every row is one contiguous range lo, lo + 1, ... (the full
  sampler's shard): each listed id marks its own column, an n x L scatter instead of the
  n x S x L compare (Delicious: 512 x 984 x 32, 0.6 ms of a 14 ms wide-and-deep step)."""
  n, s = ids.shape
  col = excluded - ids[:, :1]
  col = jnp.where((excluded >= 0) & (col >= 0) & (col < s), col, s)  # s: out of range, dropped
  return jnp.zeros((n, s), bool).at[jnp.arange(n)[:, None], col].set(True, mode="drop")


def _owned(labels_l, k_loc):
  """(n,) bool: whether this model shard's k_loc rows hold each example's positive."""
  j = jax.lax.axis_index(MODEL)
  return (labels_l >= j * k_loc) & (labels_l < (j + 1) * k_loc)


def _positive_rows(table_l, labels_l):
  """This shard's rows of the positives it owns (zeros elsewhere) and the ownership mask."""
  j = jax.lax.axis_index(MODEL)
  k_loc = table_l.shape[0]
  owned = _owned(labels_l, k_loc)
  pos_rows = precision.upcast(jnp.take(table_l, labels_l - j * k_loc, axis=0, mode="clip"))
  return jnp.where(owned[:, None], pos_rows, 0.0), owned


def positive_column(scores_l, labels_l):
  """(n,) each example's score against its positive, taken from this shard's scores (n, k_loc)
  of all its rows in order (the full sampler), zero where another shard owns the label. A
  masked sum, not a gather: its gradient is dense, with no scatter into the (n, k_loc) scores."""
  k_loc = scores_l.shape[-1]
  local = labels_l - jax.lax.axis_index(MODEL) * k_loc
  hit = jnp.arange(k_loc)[None, :] == local[:, None]
  return jnp.sum(jnp.where(hit, scores_l, 0.0), axis=-1)


class Scorer(Protocol):
  """The step's (scaled) scores of queries q (n, h) against gathered class rows."""

  def shared(self, q, rows_Sxh): ...  # -> (n, S)

  def each(self, q, rows_nxSxh): ...  # -> (n, S)


def _rescorer(scorer: Scorer, q, rows, shared: bool):
  """idx (n, k) -> scores of those draws, recomputed from their gathered rows, so the
  ordered weighted losses differentiate k rows per example instead of all S."""
  def score_at(idx):
    picked = (jnp.take(rows, idx, axis=0, mode="clip") if shared
              else jnp.take_along_axis(rows, idx[..., None], axis=1, mode="clip"))
    return scorer.each(q, picked)
  return score_at


def shared_valid_count(ids, label_set, num_labels):
  """Per example, how many of the shared draws `ids` (S,) are valid negatives:
  real labels (< num_labels) that are not in its `label_set` (n, L), padded < 0.

  Equals `sum(valid, -1)` of the (n, S) mask, but costs O(S log S + n L log S)
  instead of another pass over n x S: the draws are sorted once and every
  label's number of occurrences among them found by binary search.
  """
  draws = jnp.sort(ids)
  hits = (jnp.searchsorted(draws, label_set, side="right")
          - jnp.searchsorted(draws, label_set, side="left"))
  hits = jnp.where(_first_listing(label_set), hits, 0)
  return jnp.sum(ids < num_labels) - jnp.sum(hits, axis=-1)


def range_valid_count(ids, label_set, num_labels):
  """`shared_valid_count` for draws that are one contiguous range of labels, each once (the
  full sampler's shard: ids = lo, lo + 1, ..., hi - 1): a label is drawn iff it lies in the
  range, so the count needs no sort and no search (an XLA trace of a Delicious step put them at
  ~2 ms; the end-to-end step time was within noise in an interleaved A/B)."""
  in_range = (label_set >= ids[0]) & (label_set <= ids[-1]) & (label_set < num_labels)
  return jnp.sum(ids < num_labels) - jnp.sum(in_range & _first_listing(label_set), axis=-1)


def _first_listing(label_set):
  """(n, L) bool: a real label (>= 0) at its first position in the row. A label listed twice in
  a row must be counted once, as the (n, S) mask does."""
  col = jnp.arange(label_set.shape[1])
  repeat = jnp.any((label_set[:, :, None] == label_set[:, None, :]) & (col[None, :] < col[:, None])[None],
                   axis=-1)
  return (label_set >= 0) & ~repeat


class _StratifiedNegatives:
  """Draws of a `StratifiedSampler`: every model shard draws its own strata from its own rows."""

  def __init__(self, sampler: StratifiedSampler, mesh, stratum_cdf=None):
    num_model = mesh.shape[MODEL]
    check_strata_fit_mesh(sampler.num_strata, num_model)
    self.sampler, self.mesh, self.stratum_cdf = sampler, mesh, stratum_cdf
    self.num_labels, self.num_samples = sampler.num_labels, sampler.num_samples
    self.table_rows = sampler.padded_labels
    self.strata_per_shard = sampler.num_strata // num_model

  positives_in_scores = False

  def hits(self, ids, excluded):
    return hit_mask(ids, excluded)

  def _sample_gather(self, table_l, labels_l, example_ids_l, key, *cdf_l):
    j = jax.lax.axis_index(MODEL)
    k_loc = table_l.shape[0]
    strata = j * self.strata_per_shard + jnp.arange(self.strata_per_shard)
    cdf = cdf_l[0].reshape(self.strata_per_shard, -1) if cdf_l else None
    ids, log_q = self.sampler.sample_strata(key, strata, example_ids_l, cdf)
    if self.positives_in_scores:  # every row, in order: the shard itself, no gather
      rows = precision.upcast(table_l)
      pos_rows = jnp.zeros((labels_l.shape[0], 0), jnp.float32)
      return ids, log_q, rows, pos_rows[None], _owned(labels_l, k_loc)[None]
    # In range by construction (a shard draws from its own rows), hence "clip":
    # it skips the out-of-range masking of the default mode.
    rows = precision.upcast(jnp.take(table_l, ids - j * k_loc, axis=0, mode="clip"))
    pos_rows, owned = _positive_rows(table_l, labels_l)
    return ids, log_q, rows, pos_rows[None], owned[None]

  def draw_and_gather(self, table, batch, key) -> Draws:
    has_cdf = self.stratum_cdf is not None
    cdf_args = (self.stratum_cdf,) if has_cdf else ()
    sample_gather = jax.shard_map(
        self._sample_gather, mesh=self.mesh,
        in_specs=(TABLE, BATCH, BATCH, P()) + ((P(MODEL),) if has_cdf else ()),
        out_specs=(self.ids_spec, self.ids_spec, self.rows_spec, P(MODEL, DATA, None), P(MODEL, DATA)))
    ids, log_q, rows, pos_rows, owned = sample_gather(table, batch["label"], batch["example_id"], key,
                                                      *cdf_args)
    log_q_pos = (jnp.zeros(batch["label"].shape, jnp.float32) if has_cdf or self.sampler.full
                 else uniform_log_expected_count(self.sampler, batch["label"]))
    return Draws(ids, log_q, log_q_pos, rows, pos_rows, owned)


class SharedNegatives(_StratifiedNegatives):
  """One set of S stratified draws shared by the minibatch (`StratifiedSampler(per_example=False)`)."""
  ids_spec, rows_spec = P(MODEL), P(MODEL, None)

  @property
  def positives_in_scores(self) -> bool:
    return self.sampler.full

  def local_scores(self, q_l, rows_l, ids_l, log_q_l, scorer):
    scores = scorer.shared(q_l, rows_l)
    shape = scores.shape
    return (scores, _rescorer(scorer, q_l, rows_l, shared=True), jnp.broadcast_to(ids_l[None], shape),
            jnp.broadcast_to(log_q_l[None], shape), True)

  def valid_count(self, valid, ids_l, label_set_l):
    del valid
    if self.sampler.full:  # this shard's rows in order, each once
      return range_valid_count(ids_l, label_set_l, self.num_labels)
    return shared_valid_count(ids_l, label_set_l, self.num_labels)

  def hits(self, ids, excluded):
    return range_hit_mask(ids, excluded) if self.sampler.full else hit_mask(ids, excluded)

  def rows_to_update(self, ids_l, row_grads_l):
    return ids_l, row_grads_l


class PerExampleNegatives(_StratifiedNegatives):
  """S stratified draws per example (`StratifiedSampler(per_example=True)`)."""
  ids_spec, rows_spec = P(DATA, MODEL), P(DATA, MODEL, None)

  def local_scores(self, q_l, rows_l, ids_l, log_q_l, scorer):
    return scorer.each(q_l, rows_l), _rescorer(scorer, q_l, rows_l, shared=False), ids_l, log_q_l, True

  def valid_count(self, valid, ids_l, label_set_l):
    del ids_l, label_set_l
    return jnp.sum(valid, axis=-1)

  def rows_to_update(self, ids_l, row_grads_l):
    # Every data shard drew its own examples' negatives.
    return (jax.lax.all_gather(ids_l, DATA, tiled=True), jax.lax.all_gather(row_grads_l, DATA, tiled=True))


class GlobalNegatives:
  """S draws per example from all K labels at once, outside the shard_map (the tree
  sampler, `ExactSampler`).

  `source.draw(key, batch) -> (ids (N, S), log_q (N, S), log_q_pos (N,))`, with the
  step's batch dict (module docstring of `snm_jax.train.core.step.make_train_step`);
  ids are global label ids (>= K: no draw, masked), replicated over `model`, and
  every shard gathers (and later updates) the rows of the draws its row range holds.
  """
  ids_spec, rows_spec = P(DATA, None), P(MODEL, DATA, None, None)
  positives_in_scores = False

  def __init__(self, source, mesh, table_rows: int | None = None):
    self.source, self.mesh = source, mesh
    self.num_labels, self.num_samples = source.num_labels, source.num_samples
    self.table_rows = table_rows or source.num_labels
    self.rows_per_shard = self.table_rows // mesh.shape[MODEL]

  @staticmethod
  def _gather_owned(table_l, labels_l, ids_l):
    j = jax.lax.axis_index(MODEL)
    k_loc = table_l.shape[0]
    local = ids_l - j * k_loc
    mine = (local >= 0) & (local < k_loc)
    rows = jnp.where(mine[..., None], precision.upcast(jnp.take(table_l, local, axis=0, mode="clip")), 0.0)
    pos_rows, owned = _positive_rows(table_l, labels_l)
    return rows[None], pos_rows[None], owned[None]

  def draw_and_gather(self, table, batch, key) -> Draws:
    ids, log_q, log_q_pos = self.source.draw(key, batch)
    rows, pos_rows, owned = jax.shard_map(
        self._gather_owned, mesh=self.mesh, in_specs=(TABLE, BATCH, P(DATA, None)),
        out_specs=(self.rows_spec, P(MODEL, DATA, None), P(MODEL, DATA)))(table, batch["label"], ids)
    return Draws(ids, log_q, log_q_pos, rows, pos_rows, owned)

  def local_scores(self, q_l, rows_l, ids_l, log_q_l, scorer):
    j = jax.lax.axis_index(MODEL)
    # A draw belongs to the shard whose row range holds it.
    mine = (ids_l >= j * self.rows_per_shard) & (ids_l < (j + 1) * self.rows_per_shard)
    return (scorer.each(q_l, rows_l[0]), _rescorer(scorer, q_l, rows_l[0], shared=False), ids_l, log_q_l,
            mine)

  def valid_count(self, valid, ids_l, label_set_l):
    del ids_l, label_set_l
    return jnp.sum(valid, axis=-1)

  def hits(self, ids, excluded):
    return hit_mask(ids, excluded)

  def rows_to_update(self, ids_l, row_grads_l):
    # Every data shard drew its own examples' negatives.
    return (jax.lax.all_gather(ids_l, DATA, tiled=True),
            jax.lax.all_gather(row_grads_l[0], DATA, tiled=True))


def for_sampler(sampler, mesh, stratum_cdf=None, table_rows: int | None = None) -> Negatives:
  """The layout of `sampler`: a `StratifiedSampler` (shared or per-example) or any
  object with `draw(key, batch)` (global), whose table has
  `table_rows` rows (default: K, the global sampler's labels unpadded)."""
  if isinstance(sampler, StratifiedSampler):
    layout = PerExampleNegatives if sampler.per_example else SharedNegatives
    return layout(sampler, mesh, stratum_cdf)
  if stratum_cdf is not None:
    raise ValueError("stratum_cdf is a stratified sampler's (unigram) argument")
  return GlobalNegatives(sampler, mesh, table_rows)
