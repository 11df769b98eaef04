"""Post-hoc logit adjustment (Menon et al., ICLR 2021, "Long-tail learning via logit adjustment").

A trained model's logits z(x, y) are re-ranked at prediction by

    score(x, y) = z(x, y) - tau log pi_y,

pi_y the label's prior (its frequency in the training data), tau >= 0: tau = 1 is the
balanced-error-optimal correction for a calibrated softmax, tau = 0 no change. It needs no
training: the bias -tau log pi (K,) is added inside the chunked top-k by the retrieval's
per-label bias path (`evaluate.make_evaluate(label_bias=...)`). The recipe chooses tau on
validation (`recipes.choose_logit_adjust`); this module holds the prior and the grid's parser, and
imports nothing of the training code, so `validation.validate` can check `recipe.logit_adjust`.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from snm_jax.errors import ConfigError

FIELD = "recipe.logit_adjust"


def parse_grid(spec: str) -> tuple[float, ...]:
  """The taus of a `recipe.logit_adjust` grid, ascending, 0 (no adjustment) always included:
  "0.5,1" -> (0.0, 0.5, 1.0); "" -> (0.0,) (off). Raises ConfigError for a value that is not a
  finite number >= 0."""
  taus = {0.0}
  for part in filter(None, (p.strip() for p in str(spec).split(","))):
    try:
      tau = float(part)
    except ValueError:
      raise ConfigError(FIELD, f"{part!r} is not a number (a grid is e.g. \"0,0.25,0.5,1\"; "
                        "\"\" = off)") from None
    if not (np.isfinite(tau) and tau >= 0):
      raise ConfigError(FIELD, f"tau must be a finite number >= 0, got {part!r}")
    taus.add(tau)
  return tuple(sorted(taus))


def log_label_prior(labels: sp.spmatrix) -> np.ndarray:
  """float64 (K,): log pi_y from a label matrix (N, K) (the training part's): pi_y = (n_y + 1) /
  (N + 2), the Laplace-smoothed fraction of points with label y, so a label never seen in training
  gets a finite prior. Multi-label priors need not sum to 1: a constant shift over labels does not
  change a ranking, only their differences do."""
  labels = sp.csc_matrix(labels)
  return log_prior_from_counts(np.diff(labels.indptr), labels.shape[0])


def log_prior_from_counts(counts: np.ndarray, num_points: int) -> np.ndarray:
  """`log_label_prior` from the label counts (K,) of `num_points` points."""
  return np.log((np.asarray(counts, np.float64) + 1.0) / (num_points + 2.0))
