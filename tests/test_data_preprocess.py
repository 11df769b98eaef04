"""Tests of feature preprocessing against scikit-learn and closed forms."""
import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.decomposition import PCA as SkPCA
from sklearn.feature_extraction.text import TfidfTransformer

from snm_jax.data import preprocess


def _counts(rng, n=60, d=25):
  x = sp.random(n, d, density=0.3, format="csr", random_state=rng, dtype=np.float32)
  x.data = rng.integers(1, 6, x.nnz).astype(np.float32)
  return x


def test_l2_normalize_rows_sparse_and_dense():
  x = _counts(np.random.default_rng(0))
  x = sp.csr_matrix(sp.diags((np.arange(60) != 4).astype(np.float32)) @ x)  # row 4 empty
  xs = preprocess.l2_normalize_rows(x)
  xd = preprocess.l2_normalize_rows(x.toarray())
  assert sp.issparse(xs) and xs.dtype == np.float32
  np.testing.assert_allclose(xs.toarray(), xd, rtol=1e-6)
  norms = np.linalg.norm(xd, axis=1)
  np.testing.assert_allclose(norms[np.arange(60) != 4], 1.0, rtol=1e-6)
  assert norms[4] == 0
  np.testing.assert_allclose(xd * np.linalg.norm(x.toarray(), axis=1, keepdims=True),
                             x.toarray(), rtol=1e-5)


@pytest.mark.parametrize("sublinear", [False, True])
def test_tfidf_matches_sklearn(sublinear):
  rng = np.random.default_rng(1)
  train, test = _counts(rng), _counts(rng, n=20)
  idf = preprocess.fit_idf(train)
  ref = TfidfTransformer(norm="l2", smooth_idf=True, sublinear_tf=sublinear).fit(train)
  np.testing.assert_allclose(idf, ref.idf_, rtol=1e-6)
  for x in (test, test.toarray()):
    out = preprocess.apply_tfidf(x, idf, sublinear_tf=sublinear)
    out = out.toarray() if sp.issparse(out) else out
    np.testing.assert_allclose(out, ref.transform(test).toarray(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("force_iterative", [False, True])
def test_pca_matches_sklearn(force_iterative):
  rng = np.random.default_rng(2)
  # Low-rank structure plus noise so the top components are well separated.
  basis = rng.standard_normal((4, 30))
  train = (rng.standard_normal((200, 4)) * [5, 4, 3, 2]) @ basis + 0.1 * rng.standard_normal(
      (200, 30)) + 1.0
  test = rng.standard_normal((15, 4)) @ basis
  train_sp = sp.csr_matrix(train.astype(np.float32))
  pca = preprocess.fit_pca(train_sp, k=4, seed=0,
                         exact_max_dim=0 if force_iterative else preprocess.EXACT_PCA_MAX_DIM)
  ref = SkPCA(n_components=4, svd_solver="full").fit(train)
  np.testing.assert_allclose(pca.explained_variance, ref.explained_variance_, rtol=1e-4)
  ours = preprocess.apply_pca(test, pca)
  theirs = ref.transform(test)
  assert ours.dtype == np.float32 and ours.shape == (15, 4)
  signs = np.sign(np.sum(ours * theirs, axis=0))
  np.testing.assert_allclose(ours, theirs * signs, rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(preprocess.apply_pca(train_sp, pca).mean(0), 0, atol=1e-3)


def test_random_projection_formula_and_norm_preservation():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((500, 300)).astype(np.float32)
  r = preprocess.gaussian_projection_matrix(300, 64, seed=5)
  np.testing.assert_allclose(np.std(r), 1 / np.sqrt(64), rtol=0.02)
  out = preprocess.random_projection(sp.csr_matrix(x), 64, seed=5)
  np.testing.assert_allclose(out, x @ r, rtol=1e-4, atol=1e-4)
  ratio = np.sum(out ** 2, 1) / np.sum(x ** 2, 1)
  # E[ratio] = 1, sd = sqrt(2/64) per row; mean over 500 rows: 1 +- 0.04 (>6 sd).
  assert abs(ratio.mean() - 1) < 0.04
  assert not np.allclose(out, preprocess.random_projection(x, 64, seed=6))
