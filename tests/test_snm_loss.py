"""SNM loss (Algorithm 1), vartheta constructors, Lemma 2, S2M averaging."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from np_reference import NP_PHI, np_owl
from snm_jax import losses
from snm_jax.losses import sampled

B, K = 8, 40


def np_snm(pos, neg, vartheta, phi, kind, mask=None):
  """Reference: full sort of the valid negatives, vartheta_1..vartheta_n."""
  valid = np.ones(neg.shape, bool) if mask is None else ~mask
  ranked = np.sort(neg[valid])[::-1]
  w = np.asarray(vartheta, np.float64)[:ranked.size]
  terms = phi(pos - ranked) if kind == "powl" else phi(-ranked)
  return np.sum(w * terms) + (phi(pos) if kind == "bowl" else 0.0)


VARTHETAS = {
    "top_k": losses.top_k_vartheta(3, B, K),
    "top_k_mean": losses.top_k_vartheta(2, B, K, scale="mean"),
    "top_k_floor": losses.top_k_vartheta(3, B, K, floor=0.05),
    "top_k_all": losses.top_k_vartheta(B, B, K),  # constant: k = 0 path
    "negative_sampling": losses.negative_sampling_vartheta(2, B, K),
    "power_law": losses.power_law_vartheta(1.0, B, K, k=5),
    "power_law_floor": losses.power_law_vartheta(0.5, B, K, k=4, floor=0.1),
    "arbitrary": np.array([3.0, 2.5, 2.5, 1.0, 0.7, 0.7, 0.2, 0.0], np.float32),
}


def _batch(rng, n=16, b=B):
  pos = rng.normal(size=n)
  neg = rng.normal(size=(n, b))
  neg[0, 1:4] = neg[0, 0]  # ties among negatives
  neg[1, 2] = pos[1]  # tie with the positive
  neg[2] *= 1e3  # large magnitudes
  pos[2] *= 1e3
  neg[3] = np.round(neg[3])  # many ties
  mask = rng.random((n, b)) < 0.3
  mask[4] = True  # every negative masked
  mask[5] = False
  mask[6, :-2] = True  # fewer valid than k
  return pos.astype(np.float32), neg.astype(np.float32), mask


def _phi(name, kind):
  # Cycle through the surrogates (exponential would overflow on the 1e3 row).
  phis = ["hinge", "squared_hinge", "logistic", "ramp"]
  return phis[(sorted(VARTHETAS).index(name) + (kind == "powl")) % len(phis)]


@pytest.fixture(scope="module")
def reference_results():
  """Every case of test_matches_numpy_reference in one program: {(name, kind): (vmapped with
  mask, vmapped without, leading batch dims without vmap)}."""
  pos, neg, mask = _batch(np.random.default_rng(0))
  fns = {(name, kind): functools.partial(losses.snm_loss, vartheta=vartheta, phi=_phi(name, kind),
                                         kind=kind)
         for name, vartheta in VARTHETAS.items() for kind in ("bowl", "powl")}
  got = jax.jit(lambda p, n, m: {case: (jax.vmap(f)(p, n, neg_mask=m), jax.vmap(f)(p, n),
                                        f(p, n, neg_mask=m)) for case, f in fns.items()})(pos, neg, mask)
  return jax.tree.map(np.asarray, got)


@pytest.mark.parametrize("name", sorted(VARTHETAS))
@pytest.mark.parametrize("kind", ["bowl", "powl"])
def test_matches_numpy_reference(name, kind, reference_results):
  vartheta = VARTHETAS[name]
  phi = _phi(name, kind)
  pos, neg, mask = _batch(np.random.default_rng(0))
  got_masked, got_plain, got_batched = reference_results[name, kind]
  p64, n64 = pos.astype(np.float64), neg.astype(np.float64)
  want_masked = [np_snm(p64[i], n64[i], vartheta, NP_PHI[phi], kind, mask[i])
                 for i in range(len(pos))]
  want_plain = [np_snm(p64[i], n64[i], vartheta, NP_PHI[phi], kind) for i in range(len(pos))]
  np.testing.assert_allclose(got_masked, want_masked, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_plain, want_plain, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_batched, got_masked, rtol=1e-6, atol=1e-6)


def test_traced_vartheta_falls_back_to_sort_and_agrees():
  pos, neg, mask = _batch(np.random.default_rng(1))
  varthetas = (VARTHETAS["top_k_floor"], VARTHETAS["arbitrary"])
  traced = jax.vmap(lambda p, n, m, t: losses.snm_loss(p, n, t, "hinge", "powl", m),
                    in_axes=(0, 0, 0, None))
  concrete = lambda v: jax.vmap(functools.partial(  # noqa: E731
      losses.snm_loss, vartheta=v, phi="hinge", kind="powl"))
  # One program: each vartheta traced (an argument) and concrete (a constant).
  got = jax.jit(lambda p, n, m, ts: [(traced(p, n, m, t), concrete(v)(p, n, neg_mask=m))
                                     for t, v in zip(ts, varthetas)])(
      pos, neg, mask, [jnp.asarray(v) for v in varthetas])
  for from_traced, from_concrete in got:
    np.testing.assert_allclose(from_traced, from_concrete, rtol=1e-6, atol=1e-6)


def _primitives(fn, *args):
  text = str(jax.make_jaxpr(fn)(*args))
  return re.findall(r"top_k\[axis=\S+ k=(\d+)\]", text), "sort[" in text


def test_uses_top_k_only_for_the_varying_head():
  pos, neg = np.float32(0.3), np.zeros(B, np.float32)
  for name, want_k in [("top_k", ["3"]), ("top_k_floor", ["3"]), ("power_law", ["5"]),
                       ("negative_sampling", []), ("top_k_all", [])]:
    fn = functools.partial(losses.snm_loss, vartheta=VARTHETAS[name], neg_mask=np.zeros(B, bool))
    assert _primitives(fn, pos, neg) == (want_k, False), name
  traced = lambda t: losses.snm_loss(pos, neg, t)
  assert _primitives(traced, jnp.asarray(VARTHETAS["top_k"])) == ([str(B)], False)


@pytest.mark.parametrize("kind", ["bowl", "powl"])
def test_masked_entries_contribute_zero_with_finite_grads(kind):
  neg = np.array([0.2, np.inf, -0.5, np.nan, 1.3, -np.inf, 1e30, 0.0], np.float32)
  mask = np.array([False, True, False, True, False, True, True, False])
  cases = [(phi, vartheta) for phi in ["exponential", "squared_hinge"]
           for vartheta in (VARTHETAS["top_k_floor"], VARTHETAS["negative_sampling"])]

  @jax.jit
  def run(p, n, m):  # one program for every case
    grads = [jax.value_and_grad(lambda p, n, v=vartheta, phi=phi: losses.snm_loss(p, n, v, phi, kind, m),
                                argnums=(0, 1))(p, n) for phi, vartheta in cases]
    return grads, losses.snm_loss(p, n, VARTHETAS["top_k"], "hinge", kind, jnp.ones(B, bool))

  results, all_masked = run(jnp.float32(0.4), neg, mask)
  for (phi, vartheta), (loss, (g_pos, g_neg)) in zip(cases, results, strict=True):
    want = np_snm(0.4, np.asarray(neg, np.float64), vartheta, NP_PHI[phi], kind, mask)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert np.isfinite(g_pos) and np.all(np.isfinite(g_neg)), (phi, g_neg)
    np.testing.assert_array_equal(np.asarray(g_neg)[mask], 0.0)
  np.testing.assert_allclose(all_masked, 0.6 if kind == "bowl" else 0.0, rtol=1e-6)


@pytest.mark.parametrize("kind", ["bowl", "powl"])
def test_grad_matches_finite_differences(kind):
  rng = np.random.default_rng(2)
  pos = 0.3
  neg = rng.permutation(np.linspace(-1.2, 1.1, B))  # distinct: no kinks of the sort
  mask = np.zeros(B, bool)
  mask[[1, 5]] = True
  vartheta = VARTHETAS["top_k_floor"]
  with jax.enable_x64(True):
    grad_fn = jax.jit(jax.grad(
        lambda p, n: losses.snm_loss(p, n, vartheta, "logistic", kind, jnp.asarray(mask)),
        argnums=(0, 1)))
    g_pos, g_neg = grad_fn(jnp.float64(pos), jnp.asarray(neg))
  f = lambda p, n: np_snm(p, n, vartheta, NP_PHI["logistic"], kind, mask)
  eps = 1e-6
  fd_neg = [(f(pos, neg + eps * e) - f(pos, neg - eps * e)) / (2 * eps) for e in np.eye(B)]
  np.testing.assert_allclose(g_neg, fd_neg, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(g_pos, (f(pos + eps, neg) - f(pos - eps, neg)) / (2 * eps), rtol=1e-6)


def test_ordered_weighted_loss_from_sharded_pieces():
  """The negatives in 2 shards (a named vmap axis stands for the mesh axis): the trainer's
  loss merges the per-shard top k and psums the tail; it equals the unsharded snm_loss."""
  pos, neg, mask = _batch(np.random.default_rng(3), b=2 * B)
  valid = ~mask
  vartheta = losses.power_law_vartheta(1.0, 2 * B, K, k=4, floor=0.02)
  head, tail = losses.split_vartheta(vartheta)
  shards = lambda x: jnp.stack([x[:, :B], x[:, B:]])  # pylint: disable=unnecessary-lambda-assignment
  sharded = lambda p: jax.vmap(lambda n, v: sampled.ordered_weighted_loss(  # noqa: E731
      p, n, v, head_minus_tail=np.asarray(head - tail, np.float32), tail=float(tail),
      phi=losses.hinge, kind="powl", axis_name="shards")[0], axis_name="shards")
  got, want = jax.jit(lambda p, n, v, m: (
      sharded(p)(shards(n), shards(v)),
      jax.vmap(functools.partial(losses.snm_loss, vartheta=vartheta, kind="powl"))(p, n, neg_mask=m)))(
      pos, neg, valid, mask)
  assert got.shape == (2, len(pos))
  np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["bowl", "powl"])
def test_lemma2_extreme_case_b_equals_k_minus_1(kind):
  rng = np.random.default_rng(4)
  num_classes = 7
  v = rng.normal(size=num_classes).astype(np.float32)
  v[5] = v[2]  # a tie
  y = 3
  neg = rng.permutation(np.delete(v, y))
  ks = (1, 3, num_classes - 1)
  varthetas = [losses.top_k_vartheta(k, num_classes - 1, num_classes) for k in ks]
  # Negative sampling with k = 1 and B = K-1 is the all-ones OWL (Weston-Watkins / Lee).
  ns_vartheta = losses.negative_sampling_vartheta(1, num_classes - 1, num_classes)
  *got, ns = jax.jit(lambda p, n: [losses.snm_loss(p, n, vt, "hinge", kind)
                                   for vt in (*varthetas, ns_vartheta)])(v[y], neg)
  for k, got_k in zip(ks, got, strict=True):
    theta = np.r_[np.full(k, 1 / k), np.zeros(num_classes - 1 - k)]
    np.testing.assert_allclose(got_k, np_owl(v.astype(np.float64), y, theta, NP_PHI["hinge"], kind),
                               rtol=1e-5)
  np.testing.assert_allclose(ns, np_owl(v.astype(np.float64), y, np.ones(num_classes - 1),
                                        NP_PHI["hinge"], kind), rtol=1e-5)


def test_negative_sampling_is_scaled_sum():
  rng = np.random.default_rng(5)
  pos, neg = np.float32(0.2), rng.normal(size=B).astype(np.float32)
  ks = (1, 3)
  gots = jax.jit(lambda p, n: [losses.snm_loss(p, n, losses.negative_sampling_vartheta(k, B, K),
                                               "logistic", "bowl") for k in ks])(pos, neg)
  for k, got in zip(ks, gots, strict=True):
    scale = (K - 1) / (k * B)
    want = NP_PHI["logistic"](0.2) + scale * np.sum(NP_PHI["logistic"](-neg.astype(np.float64)))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def _theta_reference(vartheta, num_classes):
  b = len(vartheta)
  return np.array([
      sum(vartheta[i - 1] * math.comb(j - 1, i - 1) * math.comb(num_classes - 1 - j, b - i)
          for i in range(1, b + 1)) / math.comb(num_classes - 1, b)
      for j in range(1, num_classes)])


def test_expected_owl_theta():
  for vartheta, num_classes in [(losses.top_k_vartheta(2, 5, 12), 12),
                                (losses.power_law_vartheta(1.0, 4, 7, floor=0.0), 7),
                                (losses.top_k_vartheta(2, 1 + 1, 3, floor=0.1), 3)]:
    theta = losses.expected_owl_theta(vartheta, num_classes)
    np.testing.assert_allclose(theta, _theta_reference(vartheta.astype(np.float64), num_classes),
                               rtol=1e-10)
    np.testing.assert_allclose(theta.sum(), vartheta.astype(np.float64).sum(), rtol=1e-10)
  theta = losses.expected_owl_theta(losses.top_k_vartheta(2, 5, 12), 12)
  np.testing.assert_allclose(theta[:2], 0.5, rtol=1e-6)  # 1/k for j <= k
  assert np.all(np.diff(theta) <= 1e-12) and theta[2] > 0 and theta[-1] == 0
  np.testing.assert_allclose(
      losses.expected_owl_theta(losses.negative_sampling_vartheta(3, 5, 12), 12), 1 / 3, rtol=1e-6)


@pytest.mark.parametrize("kind", ["bowl", "powl"])
def test_monte_carlo_mean_converges_to_lemma2_owl(kind):
  """E over uniform B-subsets (without replacement) of snm_loss = OWL(theta of Lemma 2)."""
  rng = np.random.default_rng(6)
  num_classes, b, draws = 12, 5, 20000
  v = rng.normal(size=num_classes).astype(np.float32)
  y = 4
  others = np.delete(v, y)
  subsets = np.argsort(rng.random((draws, num_classes - 1)), axis=1)[:, :b]
  varthetas = (losses.top_k_vartheta(2, b, num_classes),
               losses.power_law_vartheta(1.0, b, num_classes, k=3, floor=0.1))
  all_samples = jax.jit(lambda negs: [jax.vmap(functools.partial(
      losses.snm_loss, v[y], vartheta=vartheta, phi="hinge", kind=kind))(negs)
                                      for vartheta in varthetas])(others[subsets])
  for vartheta, samples in zip(varthetas, all_samples, strict=True):
    samples = np.asarray(samples, np.float64)
    mean, stderr = samples.mean(), samples.std() / np.sqrt(draws)
    theta = losses.expected_owl_theta(vartheta, num_classes)
    exact = np_owl(v.astype(np.float64), y, theta, NP_PHI["hinge"], kind)
    assert abs(mean - exact) < 4 * stderr, (mean, exact, stderr)
    # The naive guess theta = vartheta padded with zeros is rejected by the same test.
    naive = np_owl(v.astype(np.float64), y, np.r_[vartheta, np.zeros(num_classes - 1 - b)],
                   NP_PHI["hinge"], kind)
    assert abs(mean - naive) > 10 * stderr


def test_vartheta_constructors():
  np.testing.assert_allclose(losses.top_k_vartheta(2, 4, 21), [2.5, 2.5, 0, 0])
  np.testing.assert_allclose(losses.top_k_vartheta(2, 4, scale="mean"), [0.5, 0.5, 0, 0])
  np.testing.assert_allclose(losses.top_k_vartheta(2, 4, 21, floor=0.1), [2.5, 2.5, 0.1, 0.1])
  np.testing.assert_allclose(losses.negative_sampling_vartheta(2, 4, 21), [2.5] * 4)
  pl = losses.power_law_vartheta(1.0, 4, 21, k=3)
  np.testing.assert_allclose(pl, 5.0 * np.array([1, 1 / 2, 1 / 3, 0]) / (11 / 6), rtol=1e-6)
  np.testing.assert_allclose(losses.power_law_vartheta(0.0, 4, 21, k=2),
                             losses.top_k_vartheta(2, 4, 21))
  for v in (pl, losses.top_k_vartheta(1, 3, 5)):
    assert v.dtype == np.float32


@pytest.mark.parametrize("call,param", [
    (lambda: losses.top_k_vartheta(5, 4, 10), "k"),
    (lambda: losses.top_k_vartheta(0, 4, 10), "k"),
    (lambda: losses.top_k_vartheta(2.5, 4, 10), "k"),
    (lambda: losses.top_k_vartheta(2, 0, 10), "B"),
    (lambda: losses.top_k_vartheta(2, 4), "K"),
    (lambda: losses.top_k_vartheta(2, 4, 10, scale="sum"), "scale"),
    (lambda: losses.top_k_vartheta(2, 4, 10, floor=-0.1), "floor"),
    (lambda: losses.top_k_vartheta(2, 4, 10, floor=5.0), "floor"),
    (lambda: losses.negative_sampling_vartheta(5, 4, 10), "k"),
    (lambda: losses.power_law_vartheta(-1.0, 4, 10), "alpha"),
    (lambda: losses.power_law_vartheta(1.0, 4, 10, k=6), "k"),
    (lambda: losses.validate_vartheta([1.0, 2.0]), "vartheta"),
    (lambda: losses.validate_vartheta([1.0, -0.5]), "vartheta"),
    (lambda: losses.validate_vartheta(np.ones((2, 2))), "vartheta"),
    (lambda: losses.snm_loss(0.0, jnp.zeros(4), np.ones(3)), "vartheta"),
    (lambda: losses.snm_loss(0.0, jnp.zeros(3), np.array([0.1, 0.2, 0.3])), "vartheta"),
    (lambda: losses.snm_loss(0.0, jnp.zeros(3), np.ones(3), kind="owl"), "kind"),
    (lambda: losses.snm_loss(0.0, jnp.zeros(3), np.ones(3), phi="hing"), "phi"),
])
def test_invalid_arguments_raise_naming_the_parameter(call, param):
  with pytest.raises(ValueError, match=rf"^{param}\b"):
    call()


def test_split_vartheta():
  head, tail = losses.split_vartheta([3.0, 2.0, 2.0, 0.5, 0.5])
  np.testing.assert_array_equal(head, [3.0, 2.0, 2.0])
  assert tail == 0.5
  head, tail = losses.split_vartheta(losses.negative_sampling_vartheta(1, 4, 9))
  assert head.shape == (0,) and tail == 2.0
  head, tail = losses.split_vartheta(losses.top_k_vartheta(2, 6, 7))
  np.testing.assert_allclose(head, [0.5, 0.5])
  assert tail == 0.0 and isinstance(tail, float)


def test_avg_top_k_and_s2m():
  rng = np.random.default_rng(7)
  values = rng.normal(size=(3, 10)).astype(np.float32)
  values[0, :4] = 2.0  # ties at the top
  mask = rng.random((3, 10)) < 0.7
  mask[1] = False
  mask[1, [2, 7]] = True  # 2 valid < k
  mask[2] = False  # none valid
  ks = (1, 3, 10)

  @jax.jit
  def run(values, mask, ramp):  # one program
    return ([losses.avg_top_k(values, k) for k in ks], losses.avg_top_k(values, 3, mask),
            losses.s2m_loss(values[1], 10), jax.grad(losses.s2m_loss)(values[1], 3, mask[1]),
            jax.grad(losses.s2m_loss)(ramp, 2))

  top, got, s2m, g_masked, g_ramp = run(values, mask, np.arange(6.0, dtype=np.float32))
  for k, top_k in zip(ks, top, strict=True):
    np.testing.assert_allclose(top_k, np.sort(values, axis=1)[:, ::-1][:, :k].mean(1), rtol=1e-6)
  want0 = np.sort(values[0][mask[0]])[::-1][:3].mean()
  np.testing.assert_allclose(np.asarray(got), [want0, values[1, [2, 7]].mean(), 0.0], rtol=1e-6)
  np.testing.assert_allclose(s2m, values[1].mean(), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g_masked), np.where(mask[1], 0.5, 0.0))
  np.testing.assert_allclose(np.asarray(g_ramp), [0, 0, 0, 0, 0.5, 0.5])
  with pytest.raises(ValueError, match="^k"):
    losses.s2m_loss(values[0], 11)


@pytest.mark.parametrize("shape,k", [((256, 4096), 16), ((3, 2, 1024), 5), ((4096,), 1), ((8, 8192), 32)])
def test_two_stage_top_k_equals_lax_top_k(shape, k):
  """`ranking.top_k` takes the grouped two-stage path at these widths and returns
  exactly lax.top_k's values; indices too where there are no ties."""
  from snm_jax.losses import ranking  # pylint: disable=g-import-not-at-top
  assert ranking._num_groups(shape[-1], k) is not None

  @jax.jit
  def run():  # one program
    x = jax.random.normal(jax.random.key(3), shape)
    # Many ties (masked entries at the fill value, repeated values).
    t = jnp.round(x * 2) / 2
    t = jnp.where(jax.random.uniform(jax.random.key(4), shape) < 0.5, jnp.finfo(jnp.float32).min, t)
    return ranking.top_k(x, k), jax.lax.top_k(x, k), t, ranking.top_k(t, k), jax.lax.top_k(t, k)[0]

  (v, i), (v0, i0), t, (tv, ti), tv0 = jax.tree.map(np.asarray, run())
  np.testing.assert_array_equal(v, v0)
  np.testing.assert_array_equal(i, i0)
  # With ties: values still exact, and every index points at an entry holding its value.
  np.testing.assert_array_equal(tv, tv0)
  np.testing.assert_array_equal(np.take_along_axis(t, ti, -1), tv)
  assert all(len(set(row)) == k for row in ti.reshape(-1, k))


def test_top_k_small_widths_use_one_lax_top_k():
  from snm_jax.losses import ranking  # pylint: disable=g-import-not-at-top
  assert ranking._num_groups(64, 16) is None
  assert ranking._num_groups(1000, 4) is None  # no power-of-two group count divides it usefully
  top, ok, idx = jax.jit(losses.masked_top_k, static_argnums=1)(
      np.asarray([[3.0, 1.0, 2.0]], np.float32), 5, np.asarray([[True, False, True]]))
  np.testing.assert_array_equal(np.asarray(ok), [[True, True, False, False, False]])
  np.testing.assert_array_equal(np.asarray(top)[0, :2], [3.0, 2.0])
  np.testing.assert_array_equal(np.asarray(idx)[0, :2], [0, 2])
