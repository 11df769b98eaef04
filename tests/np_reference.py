"""NumPy (float64) references shared by the loss tests: the surrogates phi and
the ordered weighted loss over all classes (Reddi et al. 2019, Eqs. 3-4)."""

import math

import numpy as np

NP_PHI = {
    "hinge": lambda u: np.maximum(1 - u, 0),
    "squared_hinge": lambda u: np.maximum(1 - u, 0) ** 2,
    "logistic": lambda u: np.logaddexp(0, -u) / math.log(2),
    "exponential": lambda u: np.exp(-u),
    "ramp": lambda u: np.clip(1 - u, 0, 1),
}


def np_owl(v, y, theta, phi, kind):
  """POWL / BOWL of scores v (C,) with label y: the other classes sorted by
  decreasing score, weighted by theta."""
  others = np.sort(np.delete(v, y))[::-1]
  if kind == "powl":
    return np.sum(theta * phi(v[y] - others))
  return phi(v[y]) + np.sum(theta * phi(-others))
