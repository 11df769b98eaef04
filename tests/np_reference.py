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


# ---- the trained (sampled) losses of snm_jax.losses.sampled, per example ------
# pos (N,), neg (N, S), valid (N, S) bool; log_q (N, S), log_q_pos (N,).

def _np_log_sigmoid(x):
  return -np.logaddexp(0.0, -np.asarray(x, np.float64))


def np_sampled_softmax(pos, neg, valid, log_q, log_q_pos):
  """Jean et al. 2015: logsumexp(v_y - log q_y, {v_j - log q_j}_valid) - (v_y - log q_y)."""
  out = []
  for i in range(len(pos)):
    o_y = float(pos[i]) - float(log_q_pos[i])
    logits = [o_y] + [float(neg[i, j]) - float(log_q[i, j]) for j in range(neg.shape[1]) if valid[i, j]]
    m = max(logits)
    out.append(m + math.log(sum(math.exp(l - m) for l in logits)) - o_y)
  return np.asarray(out)


def np_mined_softmax(pos, neg, valid, log_q, log_q_pos, k):
  """Mined sampled softmax, value and gradient w.r.t. the scores. With o = v - log_q and T the k
  valid negatives of largest o: the value of `np_sampled_softmax`; d/dv_y = e^{o_y}/Z - 1,
  d/dv_j = e^{o_j}/Z for j in T, 0 elsewhere (Z = e^{o_y} + sum_valid e^{o_j}); the tail mass
  sum_{valid j not in T} e^{o_j}/Z. Returns (loss (N,), d_pos (N,), d_neg (N, S), tail (N,))."""
  n, s = neg.shape
  loss, d_pos, d_neg, tail = np.zeros(n), np.zeros(n), np.zeros((n, s)), np.zeros(n)
  for i in range(n):
    o_y = float(pos[i]) - float(log_q_pos[i])
    cols = [j for j in range(s) if valid[i, j]]
    o = {j: float(neg[i, j]) - float(log_q[i, j]) for j in cols}
    m = max([o_y] + list(o.values()))
    z = math.exp(o_y - m) + sum(math.exp(v - m) for v in o.values())
    loss[i] = m + math.log(z) - o_y
    d_pos[i] = math.exp(o_y - m) / z - 1.0
    top = sorted(cols, key=lambda j: -o[j])[:k]
    for j in cols:
      if j in top:
        d_neg[i, j] = math.exp(o[j] - m) / z
      else:
        tail[i] += math.exp(o[j] - m) / z
  return loss, d_pos, d_neg, tail


def np_logistic_ns(pos, neg, valid):
  """Bamler & Mandt Eq. 2, negatives averaged: -log s(v_y) - mean_valid log s(-v_j)."""
  out = []
  for i in range(len(pos)):
    terms = [_np_log_sigmoid(-neg[i, j]) for j in range(neg.shape[1]) if valid[i, j]]
    out.append(-_np_log_sigmoid(pos[i]) - (sum(terms) / max(len(terms), 1)))
  return np.asarray(out)


def np_adversarial_ns(pos, neg, valid, log_q, log_q_pos, lam, num_samples):
  """Bamler & Mandt Eq. 6, negatives averaged; log_q are log(S p_n)."""
  log_s = math.log(num_samples)
  out = []
  for i in range(len(pos)):
    lp_pos = float(log_q_pos[i]) - log_s
    terms = [-_np_log_sigmoid(-neg[i, j]) + lam * (float(neg[i, j]) + float(log_q[i, j]) - log_s) ** 2
             for j in range(neg.shape[1]) if valid[i, j]]
    out.append(-_np_log_sigmoid(pos[i]) + lam * (float(pos[i]) + lp_pos) ** 2
               + sum(terms) / max(len(terms), 1))
  return np.asarray(out)


def np_nce(pos, neg, valid, log_q, log_q_pos):
  """NCE with log expected counts log(S q): -log s(v_y - log_q_y) - sum_valid log s(-(v_j - log_q_j))."""
  out = []
  for i in range(len(pos)):
    terms = [_np_log_sigmoid(-(float(neg[i, j]) - float(log_q[i, j])))
             for j in range(neg.shape[1]) if valid[i, j]]
    out.append(-_np_log_sigmoid(float(pos[i]) - float(log_q_pos[i])) - sum(terms))
  return np.asarray(out)


def np_sampled_owl(pos, neg, valid, head_minus_tail, tail, phi, kind):
  """SNM Algorithm 1 over the valid sampled negatives sorted descending, with
  vartheta_j = head_minus_tail_j + tail (j < k), tail after:
  BOWL phi(v_y) + sum_j vartheta_j phi(-v_[j]); POWL sum_j vartheta_j phi(v_y - v_[j])."""
  k = len(head_minus_tail)
  out = []
  for i in range(len(pos)):
    s = sorted((float(neg[i, j]) for j in range(neg.shape[1]) if valid[i, j]), reverse=True)
    total = float(phi(pos[i])) if kind == "bowl" else 0.0
    for r, v in enumerate(s):
      w = (float(head_minus_tail[r]) + tail) if r < k else tail
      total += w * float(phi(-v if kind == "bowl" else float(pos[i]) - v))
    out.append(total)
  return np.asarray(out)
