"""Ranking metrics for extreme classification and retrieval (NumPy).

Inputs are NumPy arrays (JAX arrays are converted):
  pred: (N, k_max) int, predicted label ids, best first (-1 = no prediction).
  true: the relevant labels per point, either a padded int array (N, L) with
    -1 as padding, or a scipy.sparse matrix (N, K) whose non-zeros are the
    relevant labels.
Functions `*_at_k` return a float64 array of length k_max holding the metric
for k = 1..k_max, averaged over all N points (the Extreme Classification
Repository conventions, as in its `xclib.evaluation.xc_metrics`).
"""

from typing import Mapping, Sequence, Union

import numpy as np
import scipy.sparse as sp

LabelsLike = Union[np.ndarray, sp.spmatrix, sp.sparray]

# Jain et al. (2016) propensity parameters (A, B) used by the Extreme
# Classification Repository; any other dataset uses "default".
JAIN_PROPENSITY_AB: Mapping[str, tuple[float, float]] = {
    "wikipedia": (0.5, 0.4),  # Wikipedia-LSHTC, WikiLSHTC-325K, WikipediaLarge-500K
    "amazon": (0.6, 2.6),  # Amazon-670K, Amazon-3M
    "default": (0.55, 1.5),
}


def propensity_params(dataset: str) -> tuple[float, float]:
  """(A, B) for a dataset name: names containing "wiki" -> Wikipedia values,
  names starting with "amazon" (not AmazonCat) -> Amazon values, else default."""
  name = dataset.lower()
  if "wiki" in name:
    return JAIN_PROPENSITY_AB["wikipedia"]
  if name.startswith("amazon") and not name.startswith("amazoncat"):
    return JAIN_PROPENSITY_AB["amazon"]
  return JAIN_PROPENSITY_AB["default"]


def jain_propensities(label_counts, num_points: int, A: float = 0.55,
                      B: float = 1.5) -> np.ndarray:
  """Propensities p_l of Jain et al. 2016 (float64, shape (K,)).

  1/p_l = 1 + C (N_l + B)^{-A} with C = (ln N - 1)(B + 1)^A, N_l the number of
  training points with label l and N = `num_points`.
  """
  counts = np.asarray(label_counts, np.float64)
  c = (np.log(num_points) - 1.0) * (B + 1.0) ** A
  return 1.0 / (1.0 + c * (counts + B) ** (-A))


def _as_pred(pred, k_max: int) -> np.ndarray:
  pred = np.asarray(pred)
  if pred.ndim != 2 or pred.shape[1] < k_max:
    raise ValueError(f"pred: expected shape (N, >= k_max={k_max}), got {pred.shape}")
  return pred[:, :k_max].astype(np.int64)


def _as_csr(true, num_points: int, min_cols: int) -> sp.csr_matrix:
  """Binary CSR (N, K') of the relevant labels, duplicates removed."""
  if sp.issparse(true):
    csr = sp.csr_matrix(true, copy=True)
    csr.eliminate_zeros()
  else:
    true = np.asarray(true)
    if true.ndim == 1:
      true = true[:, None]
    if true.ndim != 2:
      raise ValueError(f"true: expected (N, L) padded ids or sparse (N, K), got {true.shape}")
    rows = np.repeat(np.arange(true.shape[0]), true.shape[1])
    cols = true.ravel().astype(np.int64)
    keep = cols >= 0
    ncols = max(min_cols, int(cols[keep].max()) + 1 if keep.any() else 0)
    csr = sp.csr_matrix((np.ones(keep.sum()), (rows[keep], cols[keep])),
                        shape=(true.shape[0], ncols))
  if csr.shape[0] != num_points:
    raise ValueError(f"true: {csr.shape[0]} rows but pred has {num_points}")
  csr.data[:] = 1.0  # duplicates were summed on construction
  return csr


def _relevance(pred: np.ndarray, csr: sp.csr_matrix) -> np.ndarray:
  """(N, k) float: 1 where pred[i, r] is a relevant label of point i."""
  n, k = pred.shape
  ok = (pred >= 0) & (pred < csr.shape[1])
  rows = np.repeat(np.arange(n), k)
  cols = np.where(ok, pred, 0).ravel()
  flags = np.asarray(csr[rows, cols]).reshape(n, k)
  return np.where(ok, flags, 0.0)


def _setup(pred, true, k_max):
  pred = _as_pred(pred, k_max)
  csr = _as_csr(true, pred.shape[0], int(pred.max(initial=-1)) + 1)
  return pred, csr, _relevance(pred, csr)


def _ranks(k_max: int) -> np.ndarray:
  return np.arange(1, k_max + 1, dtype=np.float64)


def precision_per_point(pred, true: LabelsLike, k_max: int) -> np.ndarray:
  """(N, k_max): |top_k(i) ∩ Y_i| / k per point i, for k = 1..k_max."""
  _, _, rel = _setup(pred, true, k_max)
  return np.cumsum(rel, axis=1) / _ranks(k_max)


def precision_at_k(pred, true: LabelsLike, k_max: int) -> np.ndarray:
  """P@k = mean_i |top_k(i) ∩ Y_i| / k, for k = 1..k_max."""
  return np.mean(precision_per_point(pred, true, k_max), axis=0)


def recall_per_point(pred, true: LabelsLike, k_max: int) -> np.ndarray:
  """(N, k_max): |top_k(i) ∩ Y_i| / |Y_i| per point; points with Y_i empty 0."""
  _, csr, rel = _setup(pred, true, k_max)
  n_true = np.maximum(np.diff(csr.indptr), 1)
  return np.cumsum(rel, axis=1) / n_true[:, None]


def recall_at_k(pred, true: LabelsLike, k_max: int) -> np.ndarray:
  """R@k = mean_i |top_k(i) ∩ Y_i| / |Y_i|; points with Y_i empty count 0."""
  return np.mean(recall_per_point(pred, true, k_max), axis=0)


def ndcg_per_point(pred, true: LabelsLike, k_max: int) -> np.ndarray:
  """(N, k_max): DCG@k / IDCG@k per point with binary gains, 0 for points with Y_i empty.

  DCG@k = sum_{r<=k} rel_r / log2(r+1); IDCG@k = sum_{r<=min(k,|Y_i|)} 1/log2(r+1).
  """
  _, csr, rel = _setup(pred, true, k_max)
  discount = 1.0 / np.log2(_ranks(k_max) + 1.0)
  dcg = np.cumsum(rel * discount, axis=1)
  n_true = np.diff(csr.indptr)
  ideal_flags = _ranks(k_max)[None, :] <= n_true[:, None]
  idcg = np.cumsum(ideal_flags * discount, axis=1)
  return np.where(idcg > 0, dcg / np.where(idcg > 0, idcg, 1.0), 0.0)


def ndcg_at_k(pred, true: LabelsLike, k_max: int) -> np.ndarray:
  """nDCG@k with binary gains (`ndcg_per_point`), averaged over points."""
  return np.mean(ndcg_per_point(pred, true, k_max), axis=0)


# The metrics that are means over points of a per-point value, k = 1..k_max (PSP@k is a ratio of
# sums, not one of them).
PER_POINT = {"P": precision_per_point, "R": recall_per_point, "nDCG": ndcg_per_point}


def per_point_metric(metric: str) -> tuple[str, int]:
  """("nDCG", 5) for "nDCG@5", a metric of `PER_POINT`; ValueError for any other (PSP@k, a ratio
  of sums; the retrieval metrics)."""
  name, _, k = metric.partition("@")
  if name not in PER_POINT or not k.isdigit() or int(k) < 1:
    raise ValueError(f"{metric!r} is not a mean over points of one of {sorted(PER_POINT)}@k")
  return name, int(k)


def _best_inv_propensities(csr: sp.csr_matrix, inv_p: np.ndarray, k_max: int):
  """(N, k_max): each point's relevant inverse propensities, largest first, 0-padded."""
  n = csr.shape[0]
  rows = np.repeat(np.arange(n), np.diff(csr.indptr))
  vals = inv_p[csr.indices]
  order = np.lexsort((-vals, rows))
  rows, vals = rows[order], vals[order]
  rank = np.arange(rows.size) - csr.indptr[rows]
  keep = rank < k_max
  best = np.zeros((n, k_max))
  best[rows[keep], rank[keep]] = vals[keep]
  return best


def psp_at_k(pred, true: LabelsLike, k_max: int, propensities,
             normalize: bool = True) -> np.ndarray:
  """Propensity-scored precision PSP@k for k = 1..k_max.

  PSP@k = mean_i (1/k) sum_{r<=k} rel_ir / p_{pred_ir}. With `normalize`
  (default) it is divided by the same quantity for the best achievable ranking
  of the same points (each point's relevant labels by decreasing 1/p_l): a
  ratio of means, as xclib's `psprecision` does.

  Args:
    propensities: (K,) propensities p_l in (0, 1] (see `jain_propensities`),
      covering every label id that appears in `pred` or `true`.
  """
  pred, csr, rel = _setup(pred, true, k_max)
  inv_p = 1.0 / np.asarray(propensities, np.float64)
  if inv_p.shape[0] < csr.shape[1]:
    raise ValueError(f"propensities: {inv_p.shape[0]} entries but label ids go up to "
                     f"{csr.shape[1] - 1}")
  gains = rel * inv_p[np.clip(pred, 0, inv_p.shape[0] - 1)]
  psp = np.mean(np.cumsum(gains, axis=1), axis=0) / _ranks(k_max)
  if not normalize:
    return psp
  best = _best_inv_propensities(csr, inv_p, k_max)
  best_psp = np.mean(np.cumsum(best, axis=1), axis=0) / _ranks(k_max)
  return np.divide(psp, best_psp, out=np.zeros_like(psp), where=best_psp > 0)


def retrieval_recall_at_r(pred, true_label, r_max: int) -> np.ndarray:
  """Fraction of (x, y) pairs with y among the top r predictions, r = 1..r_max.

  Args:
    pred: (N, >= r_max) int predicted ids, best first.
    true_label: (N,) int, one label per pair.
  """
  return recall_curve(first_hit_rank(pred, true_label, r_max), r_max)


def first_hit_rank(pred, true_label, r_max: int) -> np.ndarray:
  """(N,) int: the 0-based rank of each pair's label y in its top r_max predictions `pred`
  (N, >= r_max), r_max where it is not among them."""
  pred = np.asarray(pred)
  if pred.ndim != 2 or pred.shape[1] < r_max:
    raise ValueError(f"pred: expected shape (N, >= r_max={r_max}), got {pred.shape}")
  true_label = np.asarray(true_label).reshape(-1)
  if true_label.shape[0] != pred.shape[0]:
    raise ValueError(f"true_label: {true_label.shape[0]} entries, pred has {pred.shape[0]} rows")
  hit = pred[:, :r_max] == true_label[:, None]
  return np.where(hit.any(axis=1), np.argmax(hit, axis=1), r_max)


def recall_curve(ranks, r_max: int) -> np.ndarray:
  """(r_max,) float64: the fraction of the pairs whose `first_hit_rank` is below r, r = 1..r_max
  (a cumulative count of the ranks, not an (N, r_max) cumulative sum)."""
  ranks = np.asarray(ranks).reshape(-1)
  if ranks.size == 0:
    return np.full(r_max, np.nan)
  return np.cumsum(np.bincount(ranks, minlength=r_max + 1)[:r_max]) / ranks.size


def average_precision(scores, relevance) -> float:
  """Area under the precision-recall curve of one query (step-wise, no interpolation).

  AP = sum_t (R_t - R_{t-1}) P_t over decreasing score thresholds t; tied
  scores form one threshold (same as sklearn's `average_precision_score`).
  Without ties this is the mean of precision@rank over the relevant items.
  Returns nan when no item is relevant.
  """
  scores = np.asarray(scores, np.float64).reshape(-1)
  rel = np.asarray(relevance).reshape(-1) > 0
  if scores.shape != rel.shape:
    raise ValueError(f"relevance: shape {rel.shape} != scores shape {scores.shape}")
  n_rel = rel.sum()
  if n_rel == 0:
    return float("nan")
  order = np.argsort(-scores, kind="stable")
  s, r = scores[order], rel[order]
  last = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]  # end of each tie group
  tp = np.cumsum(r)[last]
  precision = tp / (last + 1.0)
  recall_gain = np.diff(np.r_[0, tp]) / n_rel
  return float(np.sum(recall_gain * precision))


def mean_average_precision(scores: Union[np.ndarray, Sequence], relevance) -> float:
  """Mean of `average_precision` over queries with at least one relevant item.

  Args:
    scores: (Q, n) array, or a sequence of Q 1-D arrays (ragged).
    relevance: same structure, binary.
  """
  aps = np.array([average_precision(s, r) for s, r in zip(scores, relevance, strict=True)])
  return float(np.nanmean(aps)) if np.any(~np.isnan(aps)) else float("nan")


def embedding_retrieval_metrics(emb_NxD, labels_N, ks=(1, 2, 4, 8)) -> dict:
  """mAUPRC and Recall@k of embeddings; each point queries all the others (relevance = same label).

  The AP of a query is `average_precision` of its ranking of the other N - 1
  points by cosine / dot product; queries without any relevant item are
  skipped (`num_queries` counts the others). Recall@k = fraction of those
  queries with a relevant item among their k nearest neighbours
  (`retrieval_recall_at_r` of the neighbours' labels).
  """
  emb = np.asarray(emb_NxD, np.float32)
  labels_N = np.asarray(labels_N)
  n = emb.shape[0]
  off_diag = ~np.eye(n, dtype=bool)
  sims = (emb @ emb.T)[off_diag].reshape(n, n - 1)
  other_labels = np.broadcast_to(labels_N[None, :], (n, n))[off_diag].reshape(n, n - 1)
  rel = other_labels == labels_N[:, None]
  keep = rel.any(1)
  out = {"map": mean_average_precision(sims[keep], rel[keep]), "num_queries": int(keep.sum())}
  top = np.argsort(-sims[keep], axis=1, kind="stable")[:, :max(ks)]
  recall = retrieval_recall_at_r(np.take_along_axis(other_labels[keep], top, 1), labels_N[keep],
                                 max(ks))
  for k in ks:
    out[f"recall@{k}"] = float(recall[k - 1])
  return out


def subpopulation_masks(train_label_counts, labels,
                        quantiles=(1 / 3, 2 / 3)) -> dict[str, np.ndarray]:
  """Head / Torso / Tail masks over test pairs by their label's training frequency.

  Thresholds q_lo, q_hi = np.quantile(f, quantiles) (linear interpolation),
  where f holds the training count N_l of every label seen in training
  (N_l > 0), one entry per label (not weighted by pairs). A pair with label l is
    tail:  N_l <= q_lo   (includes labels unseen in training),
    torso: q_lo < N_l <= q_hi,
    head:  N_l > q_hi,
  so with the defaults head = labels above the 66% quantile and tail = labels
  at or below the 33% quantile (S2M paper). Ties at a threshold fall in the
  lower group.

  Args:
    train_label_counts: (K,) training count N_l per label.
    labels: int array of test-pair labels, any shape; -1 entries (padding)
      are False in every mask.
    quantiles: (lo, hi) with 0 <= lo <= hi <= 1.

  Returns:
    {"head", "torso", "tail"} -> bool arrays shaped like `labels`, disjoint,
    covering every non-padding entry.
  """
  counts = np.asarray(train_label_counts, np.float64)
  labels = np.asarray(labels)
  lo, hi = quantiles
  if not 0 <= lo <= hi <= 1:
    raise ValueError(f"quantiles: need 0 <= lo <= hi <= 1, got {quantiles}")
  seen = counts[counts > 0]
  if seen.size == 0:
    raise ValueError("train_label_counts: no label has a positive count")
  q_lo, q_hi = np.quantile(seen, [lo, hi])
  valid = labels >= 0
  freq = np.where(valid, counts[np.where(valid, labels, 0)], 0.0)
  return {
      "head": valid & (freq > q_hi),
      "torso": valid & (freq > q_lo) & (freq <= q_hi),
      "tail": valid & (freq <= q_lo),
  }
