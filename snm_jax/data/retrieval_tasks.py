"""Retrieval tasks (config.task="retrieval"): points with one category each; every test
point is a query and its gallery is every other test point (relevance = same category).

  bibtex:    the Mulan split of Bibtex, category = one label of each point (`category_rule`);
  synthetic: clustered Gaussian classes with Zipf sizes hidden among nuisance dimensions,
             test classes disjoint from the training ones.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from snm_jax.data.datasets import load_dataset
from snm_jax.data.preprocess import apply_tfidf, fit_idf, l2_normalize_rows
from snm_jax.errors import ConfigError

TASKS = ("bibtex", "synthetic")
CATEGORY_RULES = ("rarest", "first", "most_frequent")


@dataclasses.dataclass
class RetrievalTask:
  """Train points with categories 0..C-1; test points are queries and gallery."""
  name: str
  description: str
  x_train: np.ndarray  # (N, d) float32
  y_train: np.ndarray  # (N,) int32 in [0, C)
  x_test: np.ndarray   # (Nt, d) float32
  y_test: np.ndarray   # (Nt,) int32 (any ids; only equality matters)

  @property
  def num_classes(self) -> int:
    return int(self.y_train.max()) + 1


def _categories(label_rows, counts, rule):
  """One category per point from its label set (label ids as a list)."""
  if rule == "first":
    return np.array([ls[0] for ls in label_rows])
  sign = 1 if rule == "rarest" else -1
  # Ties broken by the smaller label id.
  return np.array([min(ls, key=lambda l: (sign * counts[l], l)) for ls in label_rows])


def bibtex_task(data_dir: str = "", category_rule: str = "rarest", tfidf: bool = True) -> RetrievalTask:
  """Bibtex points with at least one label; category = the `category_rule` label of each."""
  if category_rule not in CATEGORY_RULES:
    raise ConfigError("auprc.category_rule", f"{category_rule!r} is not one of {list(CATEGORY_RULES)}")
  kw = {"data_dir": data_dir} if data_dir else {}
  train, test = load_dataset("bibtex", "train", **kw), load_dataset("bibtex", "test", **kw)
  counts = train.label_counts
  rows = {}
  for name, split in (("train", train), ("test", test)):
    lab = split.labels
    keep = np.diff(lab.indptr) > 0
    label_rows = [lab.indices[lab.indptr[i]:lab.indptr[i + 1]] for i in np.flatnonzero(keep)]
    rows[name] = (split.features[keep], _categories(label_rows, counts, category_rule))
  if tfidf:
    idf = fit_idf(rows["train"][0])
    x_tr, x_te = (apply_tfidf(rows[s][0], idf) for s in ("train", "test"))
  else:
    x_tr, x_te = (l2_normalize_rows(rows[s][0]) for s in ("train", "test"))
  y_tr, y_te = rows["train"][1], rows["test"][1]
  # Categories are relabelled 0..C-1 over the training set.
  classes, y_tr = np.unique(y_tr, return_inverse=True)
  return RetrievalTask(
      name="bibtex",
      description=(f"Bibtex (Mulan split), category = {category_rule} label of each point; "
                   f"{len(y_tr)} train / {len(y_te)} test points, {len(classes)} train "
                   f"categories; TF-IDF={tfidf}; queries and gallery = test points"),
      x_train=np.asarray(x_tr.todense(), np.float32), y_train=y_tr.astype(np.int32),
      x_test=np.asarray(x_te.todense(), np.float32), y_test=y_te.astype(np.int32))


def synthetic_task(cfg) -> RetrievalTask:
  """Clustered Gaussian classes with Zipf sizes hidden among nuisance dimensions.

  x = R [c_k + s_w e ; s_n u] with centres c_k ~ N(0, I_signal), e, u standard
  normal and R a fixed random rotation, so raw cosines are dominated by the
  nuisance block. Test classes are new centres (disjoint from training).
  `cfg`: the fields of config.auprc.synthetic.
  """
  rng = np.random.default_rng(cfg.seed)
  dim = cfg.signal_dim + cfg.nuisance_dim
  rot, _ = np.linalg.qr(rng.normal(size=(dim, dim)))

  def split(num_classes):
    ranks = rng.permutation(num_classes) + 1
    sizes = np.maximum(cfg.min_class_size,
                       (cfg.max_class_size * ranks ** -cfg.zipf_exponent).astype(int))
    centres = rng.normal(size=(num_classes, cfg.signal_dim))
    y = np.repeat(np.arange(num_classes), sizes)
    signal = centres[y] + cfg.within_class_std * rng.normal(size=(len(y), cfg.signal_dim))
    nuisance = cfg.nuisance_std * rng.normal(size=(len(y), cfg.nuisance_dim))
    return (np.concatenate([signal, nuisance], 1) @ rot.T).astype(np.float32), y.astype(np.int32)

  x_tr, y_tr = split(cfg.num_train_classes)
  x_te, y_te = split(cfg.num_test_classes)
  return RetrievalTask(
      name="synthetic",
      description=(f"synthetic long-tailed Gaussian classes: {cfg.num_train_classes} train / "
                   f"{cfg.num_test_classes} disjoint test classes, sizes ~ "
                   f"{cfg.max_class_size} k^-{cfg.zipf_exponent} (min {cfg.min_class_size}), "
                   f"{cfg.signal_dim} signal + {cfg.nuisance_dim} nuisance dims; "
                   f"{len(y_tr)} train / {len(y_te)} test points"),
      x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)


def make_task(config) -> RetrievalTask:
  """The task config.dataset.name names, with the options of config.auprc."""
  name, a = config.dataset.name, config.auprc
  if name == "bibtex":
    return bibtex_task(config.dataset.data_dir, a.category_rule, a.tfidf)
  if name == "synthetic":
    return synthetic_task(a.synthetic)
  raise ConfigError("dataset.name", f"{name!r} is not a retrieval task; choose from {list(TASKS)}")
