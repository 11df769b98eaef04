"""Weights vartheta for stochastic negative mining (SNM paper, Alg. 1, Lemma 2).

vartheta (B,) weights the B sampled negatives after sorting them by score
(largest first). All constructors run eagerly in NumPy and raise `ValueError`
naming the bad parameter, so invalid weightings fail before any `jit`.

Lemma 2: if the B negatives are drawn uniformly WITHOUT replacement from the
K-1 negatives, E[SNM loss] is the exact OWL with
  theta_j = sum_{i=1}^{B} vartheta_i C(j-1, i-1) C(K-1-j, B-i) / C(K-1, B),
the probability that the j-th largest negative is drawn and ranks i-th in the
sample (`expected_owl_theta`). For `top_k_vartheta(k, B, K)` (scale
"expectation") this gives theta_j = 1/k for j <= k (plus a decaying tail when
B < K-1, none when B = K-1); for `negative_sampling_vartheta(k, B, K)` it gives
theta_j = 1/k for every j.
"""

import numbers
from typing import Optional

import numpy as np

_SCALES = ("expectation", "mean")


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{name}: must be an int, got {value!r}")
  if value < minimum:
    raise ValueError(f"{name}: must be >= {minimum}, got {value}")
  return int(value)


def _check_scale(scale: str, num_classes) -> None:
  if scale not in _SCALES:
    raise ValueError(f"scale: must be one of {_SCALES}, got {scale!r}")
  if scale == "expectation" and num_classes is None:
    raise ValueError("K: required when scale='expectation' (weights are (K-1)/(kB))")


def _check_k_b(k, num_negatives):
  num_negatives = _check_int("B", num_negatives, 1)
  k = _check_int("k", k, 1)
  if k > num_negatives:
    raise ValueError(f"k: must be <= B = {num_negatives}, got k = {k}")
  return k, num_negatives


def _with_floor(vartheta_B: np.ndarray, k: int, floor: float) -> np.ndarray:
  floor = float(floor)
  if not (np.isfinite(floor) and floor >= 0):
    raise ValueError(f"floor: must be finite and >= 0, got {floor}")
  if k < vartheta_B.shape[0] and floor > vartheta_B[k - 1]:
    raise ValueError(
        f"floor: {floor} exceeds vartheta_k = {vartheta_B[k - 1]}, which would "
        "make vartheta increasing")
  vartheta_B[k:] = floor
  return vartheta_B


def validate_vartheta(vartheta, num_negatives: Optional[int] = None) -> np.ndarray:
  """Checks a concrete weighting and returns it as float32 (B,).

  Raises:
    ValueError (naming `vartheta`): not 1-D, wrong length, not finite,
      negative, or increasing anywhere.
  """
  v = np.asarray(vartheta, dtype=np.float32)
  if v.ndim != 1 or v.shape[0] == 0:
    raise ValueError(f"vartheta: must be a non-empty 1-D array, got shape {v.shape}")
  if num_negatives is not None and v.shape[0] != num_negatives:
    raise ValueError(
        f"vartheta: length {v.shape[0]} != number of negatives B = {num_negatives}")
  if not np.all(np.isfinite(v)):
    raise ValueError("vartheta: must be finite")
  if np.any(v < 0):
    raise ValueError(f"vartheta: must be non-negative, min is {v.min()}")
  if np.any(np.diff(v) > 0):
    j = int(np.argmax(np.diff(v) > 0))
    raise ValueError(
        f"vartheta: must be non-increasing, but vartheta[{j}] = {v[j]} < "
        f"vartheta[{j + 1}] = {v[j + 1]}")
  return v


def split_vartheta(vartheta) -> tuple[np.ndarray, float]:
  """Splits a concrete vartheta (B,) into a varying head and a constant tail.

  Returns (head (k,) float32, tail float) with vartheta_j = head_j for j < k
  and vartheta_j = tail for j >= k, where k is the smallest such index
  (k = 0 for a constant vector such as negative sampling). SNM then only needs
  the top k negatives plus a plain sum over all of them:
    sum_j vartheta_j phi_[j] = sum_{j<k} (head_j - tail) phi_[j] + tail sum_j phi_j.
  """
  v = validate_vartheta(vartheta)
  tail = v[-1]
  differs = np.nonzero(v != tail)[0]
  k = int(differs[-1]) + 1 if differs.size else 0
  return v[:k].copy(), float(tail)


def top_k_vartheta(k: int, B: int, K: Optional[int] = None,
                   scale: str = "expectation", floor: float = 0.0) -> np.ndarray:
  """Top-k mining weights: vartheta_j = c for j <= k, `floor` after.

  c = (K-1)/(kB) for scale="expectation" (E[loss] is an OWL with theta_j = 1/k
  for j <= k, Lemma 2) or 1/k for scale="mean" (average of the k hardest).
  `floor` > 0 is the calibration floor of footnote 2 (vartheta_j = eps, j > k).

  Returns:
    float32 (B,).
  """
  k, B = _check_k_b(k, B)
  _check_scale(scale, K)
  if scale == "expectation":
    K = _check_int("K", K, 2)
    c = (K - 1) / (k * B)
  else:
    c = 1.0 / k
  v = np.full(B, c, np.float32)
  return validate_vartheta(_with_floor(v, k, floor), B)


def negative_sampling_vartheta(k: int, B: int, K: int) -> np.ndarray:
  """Plain negative sampling: vartheta_j = (K-1)/(kB) for all j (float32 (B,)).

  E[loss] is the OWL with theta_j = 1/k for all j (Weston-Watkins / k for POWL).
  """
  k, B = _check_k_b(k, B)
  K = _check_int("K", K, 2)
  return np.full(B, (K - 1) / (k * B), np.float32)


def power_law_vartheta(alpha: float, B: int, K: Optional[int] = None,
                       k: Optional[int] = None, scale: str = "expectation",
                       floor: float = 0.0) -> np.ndarray:
  """Power-law weights vartheta_j = c j^{-alpha} for j <= k, `floor` after.

  Harder negatives weigh more for alpha > 0. c makes sum_{j<=k} vartheta_j
  equal to that of `top_k_vartheta(k, B, K, scale)`: (K-1)/B ("expectation")
  or 1 ("mean"), so alpha = 0 recovers `top_k_vartheta`. k defaults to B.

  Returns:
    float32 (B,).
  """
  alpha = float(alpha)
  if not np.isfinite(alpha) or alpha < 0:
    raise ValueError(f"alpha: must be finite and >= 0 (alpha < 0 makes vartheta "
                     f"increasing), got {alpha}")
  k, B = _check_k_b(B if k is None else k, B)
  _check_scale(scale, K)
  total = (_check_int("K", K, 2) - 1) / B if scale == "expectation" else 1.0
  w = np.arange(1, k + 1, dtype=np.float64) ** -alpha
  v = np.zeros(B, np.float32)
  v[:k] = total * w / w.sum()
  return validate_vartheta(_with_floor(v, k, floor), B)


def _log_comb(n, r):
  from scipy import special  # pylint: disable=g-import-not-at-top  (here: scipy.special is ~0.2 s of every start-up)
  n, r = np.broadcast_arrays(np.asarray(n, np.float64), np.asarray(r, np.float64))
  ok = (r >= 0) & (r <= n)
  out = np.full(n.shape, -np.inf)
  out[ok] = (special.gammaln(n[ok] + 1) - special.gammaln(r[ok] + 1)
             - special.gammaln(n[ok] - r[ok] + 1))
  return out


def expected_owl_theta(vartheta, K: int) -> np.ndarray:
  """The OWL weights theta (K-1,) of E[SNM loss] under Lemma 2 (float64).

  theta_j = sum_i vartheta_i C(j-1, i-1) C(K-1-j, B-i) / C(K-1, B) for B
  negatives drawn uniformly without replacement from the K-1 negatives.
  """
  v = validate_vartheta(vartheta).astype(np.float64)
  B = v.shape[0]
  K = _check_int("K", K, 2)
  if B > K - 1:
    raise ValueError(f"vartheta: B = {B} negatives exceed K-1 = {K - 1}")
  i = np.arange(1, B + 1)[:, None]
  j = np.arange(1, K)[None, :]
  log_p = _log_comb(j - 1, i - 1) + _log_comb(K - 1 - j, B - i) - _log_comb(K - 1, B)
  return v @ np.exp(log_p)
