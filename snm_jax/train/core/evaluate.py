"""Evaluation: embed the test points, exact top-k over the (sharded) class table
in bounded-memory chunks, then the multi-label and retrieval metrics."""

from __future__ import annotations

import functools
import time
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from snm_jax import metrics
from snm_jax.data.pipeline import DenseBatcher, SparseBatcher
from snm_jax.mining.retrieval import bias_at, make_top_k_retrieval
from snm_jax.models import precision
from snm_jax.models.towers import l2_normalize, tower_inputs
from snm_jax.sharding import DATA, MODEL, TABLE, named
from snm_jax.train.runtime.host import to_host
from snm_jax.train.runtime.inflight import InFlight

REPORTED_K = (1, 3, 5)
# An evaluation set's chunks are kept on the devices between evaluations up to this many bytes
# (`Evaluator._chunks`; a recipe holds one validation and one test evaluator per member).
EVAL_CACHE_MAX_BYTES = 16 << 20


def first_labels(labels) -> np.ndarray:
  """Each point's first stored label, -1 for points without labels."""
  labels = labels.tocsr()
  first = np.full(labels.shape[0], -1, np.int64)
  has = np.diff(labels.indptr) > 0
  first[has] = labels.indices[labels.indptr[:-1][has]]
  return first


def propensity_ab(config, dataset_name: str | None) -> tuple[float, float]:
  """Jain et al.'s (A, B): `eval.psp_a` / `eval.psp_b` where set, else the dataset's published values."""
  a, b = metrics.propensity_params(dataset_name or "")
  return (a if config.eval.psp_a is None else config.eval.psp_a,
          b if config.eval.psp_b is None else config.eval.psp_b)


def make_evaluate(config, run_data, split: str, *, tower_apply: Callable, mesh, normalize_classes: bool,
                  max_nnz: int, max_labels: int, dense_inputs: bool = False,
                  tree_sampler=None, label_bias: np.ndarray | None = None) -> Callable:
  """`evaluate(state) -> dict` of the metrics on one split ("validation" or "test").

  Validation is scored for selection: the ranking metrics @k for k <= eval.k_max (a top-k_max
  retrieval), not the retrieval recall@r curves up to eval.recall_r, which only the test split
  reports (with r = 100 they took about half of a Delicious validation evaluation).

  Owns the method-specific parts of prediction: Bamler & Mandt's Eq. 5 bias
  removal (score_y(x) = xi_y(x) + log p_n(y|x), inside the chunked top-k) for
  the adversarial loss, evaluated with the class table in the tree's leaf order
  (`leaf_order_rows`: each scanned block is a subtree, O(C k) per query for all
  of log p_n rather than O(C k log C) label by label), their predictive log-likelihood, and on synthetic test
  data the Bayes-optimal predictor's metrics (`bayes/...`). PSP@k and the
  Head/Torso/Tail split use the whole training file's label counts, so every
  method and every split is scored with the same propensities. dense_inputs:
  the tower takes dense rows (`DenseBatcher` batches), as in training.
  label_bias: float (K,) added to every score of label y at prediction, score_y(x) + b_y (e.g.
  Menon et al.'s post-hoc logit adjustment, b = -tau log prior), through the same per-label bias
  path of the chunked top-k as Eq. 5 (not with it).
  """
  dataset = run_data.validation if split == "validation" else run_data.test
  n = config.eval.max_examples or None
  features, labels = dataset.features[:n], dataset.labels[:n]
  debias = (tree_sampler is not None and config.adversarial.debias_eval
            and config.loss.kind == "adversarial_ns")
  bias_fn = extra_fn = row_labels = None
  row_block = config.eval.row_block
  if debias:
    x_proj = np.asarray(tree_sampler.project_sparse_host(features))
    extra_fn = lambda rows: x_proj[np.maximum(rows, 0)]  # pylint: disable=unnecessary-lambda-assignment
    bias_fn = tree_sampler.log_prob_leaf_block
    row_labels, row_block = leaf_order_rows(np.asarray(tree_sampler.tree.label_of_leaf_L),
                                            mesh.shape[MODEL], row_block)
  if label_bias is not None:
    if debias:
      raise ValueError("label_bias and the adversarial loss's Eq. 5 bias removal are exclusive")
    bias_fn, extra_fn = label_bias_fn(label_bias)
  curves = split != "validation"  # the recall@r curves: test only (docstring)
  evaluator = Evaluator(
      bias_fn=bias_fn, extra_fn=extra_fn, with_loglik=config.eval.log_likelihood,
      tower_apply=tower_apply, features=features, labels=labels, mesh=mesh,
      num_labels=run_data.num_labels,
      k=(max(config.eval.k_max, min(config.eval.recall_r, run_data.num_labels)) if curves
         else config.eval.k_max),
      query_chunk=config.eval.query_chunk, row_block=row_block, row_labels=row_labels,
      normalize_classes=normalize_classes, max_nnz=max_nnz, max_labels=max_labels,
      logit_scale=float(config.loss.logit_scale) if (debias or config.eval.log_likelihood) else 1.0,
      dense_inputs=dense_inputs)
  a, b = propensity_ab(config, run_data.train.name)
  propensities = metrics.jain_propensities(run_data.label_counts, run_data.train_file_points, a, b)
  bayes_features = None
  if run_data.synthetic is not None and split == "test":
    bayes_features = run_data.synthetic.test.features[:evaluator.num_points]

  def evaluate(state, per_point: str | None = None):
    """The metrics (dict); with `per_point` a metric of `metrics.PER_POINT` such as "nDCG@5",
    (the metrics, that metric's value at each point (num_points,))."""
    t0 = time.perf_counter()
    pred, loglik = evaluator.predict(state.tower_params(), state.table)
    split_labels = evaluator.batcher.labels
    out = multilabel_metrics(pred, split_labels, propensities, config.eval.k_max)
    if curves:
      out.update(retrieval_metrics(pred, split_labels, run_data.label_counts, config.eval.recall_r))
    if loglik is not None:  # Bamler & Mandt's predictive log-likelihood of the first label
      out["log_likelihood"] = float(np.nanmean(loglik))
      out["accuracy"] = float(np.mean(pred[:, 0] == first_labels(split_labels)))
    if bayes_features is not None:
      bayes, _ = run_data.synthetic.bayes_topk(bayes_features, config.eval.k_max)
      b_out = multilabel_metrics(np.asarray(bayes), split_labels, propensities, config.eval.k_max)
      out.update({f"bayes/{k}": v for k, v in b_out.items()})
    out["eval_seconds"] = time.perf_counter() - t0
    if per_point is None:
      return out
    name, k = metrics.per_point_metric(per_point)
    return out, metrics.PER_POINT[name](pred, split_labels, k)[:, k - 1]

  return evaluate


def leaf_order_rows(label_of_leaf, model_shards: int, row_block: int) -> tuple[np.ndarray, int]:
  """The evaluation's class-table layout in a tree's leaf order, for Eq. 5 block by subtree.

  Args:
    label_of_leaf: (L,) int, the label at each leaf (L a power of two), -1 for padding.
    model_shards: the mesh's `model` axis size M.
    row_block: the configured rows per retrieval block (`eval.row_block`).

  Returns:
    row_labels: (L_pad,) int32, the label of each row of the permuted table: label_of_leaf, then
      -1 up to L_pad, the smallest multiple of M x block >= L (so each shard holds whole blocks).
    block: the retrieval's row block, the largest power of two <= row_block and <= L / M (>= 1).
      The retrieval then scans each shard's rows in aligned blocks (it shifts a block back only
      when the shard's rows are not a multiple of it), so every block is a whole subtree.
  """
  label_of_leaf = np.asarray(label_of_leaf, np.int32)
  num_leaves = label_of_leaf.shape[0]
  limit = max(1, min(row_block, num_leaves // model_shards))
  block = 1 << (limit.bit_length() - 1)
  num_rows = -(-num_leaves // (model_shards * block)) * model_shards * block
  return np.concatenate([label_of_leaf, np.full(num_rows - num_leaves, -1, np.int32)]), block


def label_bias_fn(label_bias) -> tuple[Callable, Callable]:
  """A per-label bias b (K,) as the retrieval's (bias_fn(extra (n,), ids (r,)) -> (n, r) = b[ids],
  extra_fn(example rows) -> zeros (n,)): the bias does not depend on x, `extra` only carries the
  query count (and sharding) the retrieval's bias interface expects. Ids past K (padding) get 0."""
  bias = jnp.asarray(np.asarray(label_bias, np.float32))

  def bias_fn(extra, ids):
    return jnp.broadcast_to(jnp.take(bias, ids, mode="fill", fill_value=0.0)[None],
                            (extra.shape[0],) + ids.shape)

  return bias_fn, lambda rows: np.zeros(len(rows), np.float32)


class Evaluator:
  """Top-k predictions of a trained model on a fixed set of points.

  Every process holds the whole evaluation set (it is small next to training
  data); each chunk of `query_chunk` points is embedded and retrieved with the
  batch sharded over `data` and the table over `model`.

  row_labels: optional (R,) int, R divisible by the `model` axis size: `predict` then permutes
  the table once per call into rows table[row_labels] (still sharded over `model`; a second copy
  of R rows), retrieves over those R rows and maps the ids back to labels. `bias_fn` then takes
  row ids; rows past the last real label are never candidates, and the bias must rule out the
  padding rows (label -1) before it (-inf, or like the tree's padding leaves <= -1e4, whose exp is
  exactly 0 in float32). Used for Eq. 5 in the tree's leaf order (`leaf_order_rows`).
  """

  def __init__(self, *, tower_apply: Callable, features, labels, mesh, num_labels: int,
               k: int, query_chunk: int, row_block: int, normalize_classes: bool,
               max_nnz: int, max_labels: int, bias_fn=None, extra_fn=None,
               with_loglik: bool = False, logit_scale: float = 1.0, dense_inputs: bool = False,
               row_labels: np.ndarray | None = None):
    n_data = mesh.shape[DATA]
    # Never pad a small evaluation set up to a large chunk.
    chunk = -(-min(query_chunk, features.shape[0]) // n_data) * n_data
    self.mesh, self.k, self.extra_fn = mesh, k, extra_fn
    self.num_points = features.shape[0]
    batcher = DenseBatcher if dense_inputs else SparseBatcher
    self._cached = None  # the chunks on the devices, once read (`_chunks`)
    self.batcher = batcher(features, labels, None, global_batch_size=chunk,
                                 max_nnz=max_nnz, max_labels=max_labels, shuffle=False,
                                 num_epochs=1, process_index=0, process_count=1, log_epochs=False)
    # The model's logits are logit_scale x (q . row): the scale matters where they are added to
    # log p_n(y|x) (Eq. 5) or normalised (log-likelihood); P@k and the other rankings ignore it,
    # and are computed from unscaled scores when neither is asked for.
    self.embed = _embed_fn(tower_apply, logit_scale)
    self.with_loglik = with_loglik
    self.row_labels = self.row_of_label = None
    if row_labels is not None:
      self.row_labels = np.asarray(row_labels, np.int32)
      if self.row_labels.shape[0] % mesh.shape[MODEL]:
        raise ValueError(f"{self.row_labels.shape[0]} table rows are not divisible by the "
                         f"{mesh.shape[MODEL]} model shards")
      real = np.flatnonzero(self.row_labels >= 0)
      self.row_of_label = np.full(num_labels, -1, np.int32)
      self.row_of_label[self.row_labels[real]] = real
      self._gather_rows = jnp.asarray(np.maximum(self.row_labels, 0))  # padding rows: any row
      self._permute = jax.jit(lambda table, rows: jnp.take(table, rows, axis=0),
                              out_shardings=named(mesh, TABLE))
      num_labels = int(real[-1]) + 1   # the retrieval's "labels": rows up to the last real one
    self.retrieve = make_top_k_retrieval(mesh, k=k, num_labels=num_labels, row_block=row_block,
                                         normalize_classes=normalize_classes, bias_fn=bias_fn,
                                         with_logsumexp=with_loglik)
    self._sharding = named(mesh, jax.P(DATA))

    @jax.jit
    def label_scores(q, table, labels, extra):
      """Score (with the bias, if any) of one given label per query: (n,)."""
      rows = precision.upcast(jnp.take(table, jnp.maximum(labels, 0), axis=0))  # a bf16 table too
      rows = l2_normalize(rows) if normalize_classes else rows
      s = jnp.sum(q * rows, axis=-1)
      if bias_fn is not None:
        s = s + bias_at(bias_fn, extra, jnp.maximum(labels, 0))
      return s

    self._label_scores = label_scores

  def _chunks(self):
    """Per chunk of the evaluation set: (the tower's inputs, the bias's `extra` or None, the rows
    of each point's first label or None, on the devices; valid (n,); first label (n,) or None).

    Read from the batcher on the first call. While the chunks' arrays come to at most
    EVAL_CACHE_MAX_BYTES they are kept and the later calls reuse them: a validation split is
    scored at every evaluation of every candidate, and each pass through the batcher cost ~10 ms
    of Grain's iterator set-up (Bibtex's 488 validation points: about as long as scoring them)."""
    if self._cached is not None:
      yield from self._cached
      return
    kept, nbytes = [], 0
    put = lambda x: jax.device_put(x, self._sharding)  # pylint: disable=unnecessary-lambda-assignment
    self.batcher.set_state({"epoch": 0, "position": 0})
    for batch in self.batcher:
      inputs = tuple(map(put, tower_inputs(batch)))
      extra = None if self.extra_fn is None else put(self.extra_fn(batch["example_id"]))
      first = label_rows = None
      if self.with_loglik:
        first = np.asarray(batch["label_set"][:, 0])
        label_rows = put(first if self.row_of_label is None
                         else np.where(first >= 0, self.row_of_label[first], -1))
      chunk = (inputs, extra, label_rows, batch["valid"], first)
      if kept is not None:
        nbytes += sum(x.nbytes for x in jax.tree.leaves(chunk[:3]))
        if nbytes <= EVAL_CACHE_MAX_BYTES:
          kept.append(chunk)
        else:
          kept = None
      yield chunk
    self._cached = kept

  def predict(self, params, table):
    """Returns (pred (num_points, k) int ids best first, -1 if K < k;
    log-likelihood (num_points,) of each point's first label, NaN without one,
    or None unless `with_loglik`)."""
    pending = []  # per chunk: (its top-k ids, log-likelihoods or None, on the devices; valid; first)
    if self.row_labels is not None:
      table = self._permute(table, self._gather_rows)
    # Chunks are dispatched ahead of reading any result back (a read per chunk stalled both host
    # and devices), at most `InFlight`'s bound ahead: each queued chunk holds its inputs on the devices.
    in_flight = InFlight()
    for inputs, extra, label_rows, valid, first in self._chunks():
      q = self.embed(params, *inputs)
      res = self.retrieve(q, table, *(() if extra is None else (extra,)))
      ll = None
      if self.with_loglik:
        ll = self._label_scores(q, table, label_rows, extra) - res[2]
      pending.append((res[1], ll, valid, first))
      in_flight.add(res[1])
    out, lls = [], []
    for ids, ll, valid, first in pending:
      ids = to_host(ids)
      if self.row_labels is not None:
        ids = np.where(ids >= 0, self.row_labels[ids], -1)
      out.append(ids[valid])
      if ll is not None:
        lls.append(np.where(first >= 0, to_host(ll), np.nan)[valid])
    pred = np.concatenate(out)[:self.num_points]
    return pred, (np.concatenate(lls)[:self.num_points] if self.with_loglik else None)


def _embed_fn(tower_apply: Callable, logit_scale: float) -> Callable:
  """jit(logit_scale x tower_apply). The `apply` of a flax module is keyed on the module (equal
  modules: one jitted function), so the evaluators of every run and candidate with the same tower
  trace, lower and compile their embedding once per process (a fresh jit per evaluator cost ~1 s
  each on Delicious, cache hits included)."""
  module = getattr(tower_apply, "__self__", None)
  if isinstance(module, nn.Module) and getattr(tower_apply, "__name__", "") == "apply":
    return _module_embed(module, logit_scale)
  return _make_embed(tower_apply, logit_scale)


@functools.lru_cache(maxsize=32)
def _module_embed(module: nn.Module, logit_scale: float) -> Callable:
  return _make_embed(module.apply, logit_scale)


def _make_embed(tower_apply: Callable, logit_scale: float) -> Callable:
  return jax.jit(lambda *a: logit_scale * tower_apply(*a)) if logit_scale != 1.0 else jax.jit(tower_apply)


def multilabel_metrics(pred: np.ndarray, labels: sp.csr_matrix, propensities, k_max: int) -> dict:
  """P@k, R@k, nDCG@k, PSP@k (normalised) for k in REPORTED_K (<= k_max)."""
  out = {}
  for name, fn in (("P", metrics.precision_at_k), ("R", metrics.recall_at_k),
                   ("nDCG", metrics.ndcg_at_k)):
    vals = fn(pred, labels, k_max)
    out.update({f"{name}@{k}": float(vals[k - 1]) for k in REPORTED_K if k <= k_max})
  psp = metrics.psp_at_k(pred, labels, k_max, propensities)
  out.update({f"PSP@{k}": float(psp[k - 1]) for k in REPORTED_K if k <= k_max})
  return out


def retrieval_metrics(pred: np.ndarray, labels: sp.csr_matrix, train_label_counts,
                      r_max: int) -> dict:
  """Retrieval recall@r over all (x, y) test pairs, overall and per Head/Torso/Tail.

  Returns {"recall@r": [r=1..r_max], "recall@r/head": [...], ...}.
  """
  labels = sp.csr_matrix(labels)
  rows = np.repeat(np.arange(labels.shape[0]), np.diff(labels.indptr))
  pair_labels = labels.indices
  r_max = min(r_max, pred.shape[1])
  ranks = metrics.first_hit_rank(pred[rows, :r_max], pair_labels, r_max)
  out = {"recall@r": metrics.recall_curve(ranks, r_max).tolist()}
  masks = metrics.subpopulation_masks(train_label_counts, pair_labels)
  for name, mask in masks.items():
    if mask.any():
      out[f"recall@r/{name}"] = metrics.recall_curve(ranks[mask], r_max).tolist()
      out[f"num_pairs/{name}"] = int(mask.sum())
  return out
