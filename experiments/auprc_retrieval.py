r"""SOPRC on retrieval: mAUPRC and Recall@k of an embedding tower (issue 7).

  python -m experiments.auprc_retrieval --workdir=/tmp/auprc_retrieval \
      --config.results_dir=results/auprc
  python -m experiments.auprc_retrieval --workdir=/tmp/auprc_tiny \
      --config=experiments/configs/auprc_retrieval.py:runlocal

Every test point is a query; its gallery is every other test point; relevance =
same category. An MLP tower is trained on class-balanced batches (G classes x M
samples) with SOPRC (Eq. 8 + aux vector, Eq. 10), the AP loss (Eq. 5),
Smooth-AP, triplet and contrastive losses. Finished runs are stored under
workdir/runs/ and skipped when the command is run again.
"""
import dataclasses
import functools
import json
import os
import pathlib
import platform
import sys
import time

from absl import app, flags, logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np
import optax

from snm_jax import auprc
from snm_jax import data
from snm_jax.errors import ConfigError, NonFiniteLossError
from snm_jax.losses import cosine_contrastive_loss

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "auprc_retrieval.py")


def _define_flags():
  """Flags exist only when this file runs as a program: tests import its functions
  next to other absl apps, whose flags of the same names would collide."""
  config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Path to a get_config() file[:variant].",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Run directory (per-run results, tables).")

METHODS = ("soprc", "soprc_sg", "soprc_sg_var", "ap_loss", "smooth_ap", "triplet",
           "contrastive")


# ------------------------------------------------------------------ tasks ----
@dataclasses.dataclass
class RetrievalTask:
  """Train points with categories 0..C-1; test points are queries and gallery."""
  name: str
  description: str
  x_train: np.ndarray  # (N, d) float32
  y_train: np.ndarray  # (N,) int32 in [0, C)
  x_test: np.ndarray   # (Nt, d) float32
  y_test: np.ndarray   # (Nt,) int32 (any ids; only equality matters)


def _categories(label_rows, counts, rule):
  """One category per point from its label set (label ids as a list)."""
  if rule == "first":
    return np.array([ls[0] for ls in label_rows])
  sign = 1 if rule == "rarest" else -1
  # Ties broken by the smaller label id.
  return np.array([min(ls, key=lambda l: (sign * counts[l], l)) for ls in label_rows])


def bibtex_task(cfg) -> RetrievalTask:
  if cfg.category_rule not in ("rarest", "first", "most_frequent"):
    raise ConfigError("bibtex.category_rule", f"unknown rule {cfg.category_rule!r}")
  kw = {"data_dir": cfg.data_dir} if cfg.data_dir else {}
  train, test = data.load_dataset("bibtex", "train", **kw), data.load_dataset("bibtex", "test", **kw)
  counts = train.label_counts
  rows = {}
  for name, split in (("train", train), ("test", test)):
    lab = split.labels
    keep = np.diff(lab.indptr) > 0
    label_rows = [lab.indices[lab.indptr[i]:lab.indptr[i + 1]] for i in np.flatnonzero(keep)]
    rows[name] = (split.features[keep], _categories(label_rows, counts, cfg.category_rule))
  if cfg.tfidf:
    idf = data.fit_idf(rows["train"][0])
    x_tr, x_te = (data.apply_tfidf(rows[s][0], idf) for s in ("train", "test"))
  else:
    x_tr, x_te = (data.l2_normalize_rows(rows[s][0]) for s in ("train", "test"))
  y_tr, y_te = rows["train"][1], rows["test"][1]
  # Categories are relabelled 0..C-1 over the training set.
  classes, y_tr = np.unique(y_tr, return_inverse=True)
  return RetrievalTask(
      name="bibtex",
      description=(f"Bibtex (Mulan split), category = {cfg.category_rule} label of each point; "
                   f"{len(y_tr)} train / {len(y_te)} test points, {len(classes)} train "
                   f"categories; TF-IDF={cfg.tfidf}; queries and gallery = test points"),
      x_train=np.asarray(x_tr.todense(), np.float32), y_train=y_tr.astype(np.int32),
      x_test=np.asarray(x_te.todense(), np.float32), y_test=y_te.astype(np.int32))


def synthetic_task(cfg) -> RetrievalTask:
  """Clustered Gaussian classes with Zipf sizes hidden among nuisance dimensions.

  x = R [c_k + s_w e ; s_n u] with centres c_k ~ N(0, I_signal), e, u standard
  normal and R a fixed random rotation, so raw cosines are dominated by the
  nuisance block. Test classes are new centres (disjoint from training).
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


def make_task(name, config) -> RetrievalTask:
  if name == "bibtex":
    return bibtex_task(config.bibtex)
  if name == "synthetic":
    return synthetic_task(config.synthetic)
  raise ConfigError("tasks", f"unknown task {name!r}; choose bibtex | synthetic")


# ------------------------------------------------------------------ model ----
class EmbeddingTower(nn.Module):
  """x (N, d) -> Dense -> ReLU -> Dense -> L2 normalise -> (N, embed_dim)."""
  hidden: int
  embed_dim: int

  @nn.compact
  def __call__(self, x):
    e = nn.Dense(self.embed_dim)(nn.relu(nn.Dense(self.hidden)(x)))
    return e * jax.lax.rsqrt(jnp.sum(e * e, axis=-1, keepdims=True) + 1e-12)


# ---------------------------------------------------------- batch losses ----
def _gather_rows(values_BxB, mask_BxB, k):
  """Per row, the k entries where mask is True: ((B, k) values, (B, k) mask)."""
  idx = jnp.argsort(~mask_BxB, axis=1, stable=True)[:, :k]
  return (jnp.take_along_axis(values_BxB, idx, 1), jnp.take_along_axis(mask_BxB, idx, 1))


def batch_loss(method, cfg, scores_BxB, labels_B, aux, prior_C, eps_C, num_pos):
  """Mean over the B queries of a batch of the method's per-query loss.

  Query i ranks the other B - 1 items; its positives are the num_pos = M - 1
  other members of its group.
  """
  b = scores_BxB.shape[0]
  valid = ~jnp.eye(b, dtype=bool)
  pos = (labels_B[:, None] == labels_B[None, :]) & valid
  if method.startswith("soprc"):
    c = cfg.soprc
    loss_fn = functools.partial(
        auprc.soprc_loss, tau1=c.tau1, tau2=c.tau2, max_positives=num_pos,
        stop_gradient_denominator_positive=method.startswith("soprc_sg"))
    per_query = jax.vmap(lambda s, p, va, v, pr, e: loss_fn(
        s, p, v, pr, eps=e, valid_mask_B=va))(
            scores_BxB, pos, valid, aux.v[labels_B], prior_C[labels_B], eps_C[labels_B])
    loss = jnp.mean(per_query)
    if method == "soprc_sg_var":
      loss += jnp.mean(jax.vmap(lambda s, p, va: auprc.semi_variance(
          s, p, c.lambda_pos, c.lambda_neg, va))(scores_BxB, pos, valid))
    return loss
  if method == "ap_loss":
    return jnp.mean(jax.vmap(lambda s, p, va: auprc.ap_loss(
        s, p, tau1=cfg.ap_loss.tau1, tau2=cfg.ap_loss.tau2, valid_mask_B=va,
        max_positives=num_pos))(scores_BxB, pos, valid))
  if method == "smooth_ap":
    return jnp.mean(jax.vmap(lambda s, p, va: auprc.smooth_ap_loss(
        s, p, temperature=cfg.smooth_ap.temperature, valid_mask_B=va,
        max_positives=num_pos))(scores_BxB, pos, valid))
  pos_BxP, pos_ok_BxP = _gather_rows(scores_BxB, pos, num_pos)
  neg = valid & ~pos
  if method == "triplet":
    hinge = jax.nn.relu(scores_BxB[:, None, :] - pos_BxP[:, :, None] + cfg.triplet.margin)
    ok = pos_ok_BxP[:, :, None] & neg[:, None, :]
    return jnp.sum(hinge * ok) / jnp.maximum(jnp.sum(ok), 1)
  if method == "contrastive":
    per_pair = cosine_contrastive_loss(
        pos_BxP, jnp.broadcast_to(scores_BxB[:, None, :], pos_BxP.shape + (b,)),
        margin=cfg.contrastive.margin, neg_mask=~neg[:, None, :])
    return jnp.sum(per_pair * pos_ok_BxP) / jnp.maximum(jnp.sum(pos_ok_BxP), 1)
  raise ConfigError("methods", f"unknown method {method!r}; choose from {METHODS}")


def _aux_targets(scores_BxB, num_groups, m):
  """Within-group positive-pair scores: (G, M*M) values and mask (off-diagonal)."""
  blocks = scores_BxB.reshape(num_groups, m, num_groups, m)
  blocks = blocks[jnp.arange(num_groups), :, jnp.arange(num_groups), :]  # (G, M, M)
  mask = jnp.broadcast_to(~jnp.eye(m, dtype=bool), blocks.shape)
  return blocks.reshape(num_groups, m * m), mask.reshape(num_groups, m * m)


# --------------------------------------------------------------- training ----
def class_priors(y_train, num_classes, prior_mul):
  """(prior_C, eps_C): pi_k for (1 - pi)/pi and the guard 1/N+_k of Eq. 8."""
  counts = np.bincount(y_train, minlength=num_classes).astype(np.float64)
  if prior_mul > 0:
    prior = prior_mul * counts / counts.max()
  else:
    prior = (counts - 1) / (len(y_train) - 1)
  prior = np.clip(prior, 1e-6, 1 - 1e-6)
  eps = 1.0 / np.maximum(counts - 1, 1)
  return jnp.asarray(prior, jnp.float32), jnp.asarray(eps, jnp.float32)


@functools.lru_cache(maxsize=None)
def _compiled_train(method, cfg, num_classes):
  """One jitted lax.scan over all steps per (method, config); reused across seeds."""
  tc = cfg.train
  m = tc.samples_per_class
  g = tc.batch_size // m
  model = EmbeddingTower(cfg.model.hidden, cfg.model.embed_dim)
  tx = optax.adam(tc.learning_rate)

  def run(params, x_train, batch_idx_TxB, batch_cls_TxG, prior_C, eps_C):
    aux = auprc.init_aux_vector(num_classes, cfg.soprc.num_aux, (-1.0, 1.0))

    def step(carry, batch):
      params, opt_state, aux = carry
      idx_B, cls_G = batch
      labels_B = jnp.repeat(cls_G, m)

      def loss_fn(p):
        e = model.apply(p, x_train[idx_B])
        scores = e @ e.T
        return batch_loss(method, cfg, scores, labels_B, aux, prior_C, eps_C, m - 1), scores

      (loss, scores), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      if method.startswith("soprc"):
        values, mask = _aux_targets(scores, g, m)
        aux = auprc.update_aux_vector(
            aux, cls_G, values, mask, beta=cfg.soprc.beta, score_range=(-1.0, 1.0),
            init_from_first_batch=cfg.soprc.init_from_first_batch)
      return (params, opt_state, aux), loss

    (params, _, aux), losses = jax.lax.scan(
        step, (params, tx.init(params), aux), (batch_idx_TxB, batch_cls_TxG))
    return params, aux, losses

  return jax.jit(run), model


def train_one(method, config, task, seed, batches):
  """Trains one tower; returns (params, losses (T,), model)."""
  num_classes = int(task.y_train.max()) + 1
  run, model = _compiled_train(method, ml_collections.FrozenConfigDict(config), num_classes)
  params = model.init(jax.random.key(seed), jnp.zeros((1, task.x_train.shape[1])))
  prior_C, eps_C = class_priors(task.y_train, num_classes, config.soprc.prior_mul)
  params, _, losses = run(params, jnp.asarray(task.x_train), jnp.asarray(batches[0]),
                          jnp.asarray(batches[1], jnp.int32), prior_C, eps_C)
  losses = np.asarray(losses)
  bad = np.flatnonzero(~np.isfinite(losses))
  if bad.size:
    raise NonFiniteLossError(f"{task.name}/{method}/seed {seed}: loss {losses[bad[0]]} "
                             f"at step {bad[0]}")
  return params, losses, model


# ------------------------------------------------------------- evaluation ----
def retrieval_metrics(emb_NxD, labels_N, ks=(1, 2, 4, 8)):
  """mAUPRC and Recall@k; each point queries all the others (relevance = same label).

  AP of a query = mean over its relevant items of precision at their rank
  (scores are continuous, so ties have probability 0). Queries without any
  relevant item are skipped. Recall@k = fraction of queries with a relevant
  item among their k nearest neighbours.
  """
  emb = np.asarray(emb_NxD, np.float32)
  n = emb.shape[0]
  sims = emb @ emb.T
  np.fill_diagonal(sims, -np.inf)
  rel = labels_N[:, None] == labels_N[None, :]
  np.fill_diagonal(rel, False)
  n_rel = rel.sum(1)
  keep = n_rel > 0
  order = np.argsort(-sims[keep], axis=1, kind="stable")[:, :n - 1]  # self comes last
  rel_sorted = np.take_along_axis(rel[keep], order, 1)
  precision = np.cumsum(rel_sorted, 1) / np.arange(1, n)
  ap = np.sum(precision * rel_sorted, 1) / n_rel[keep]
  out = {"map": float(ap.mean()), "num_queries": int(keep.sum())}
  for k in ks:
    out[f"recall@{k}"] = float(rel_sorted[:, :k].any(1).mean())
  return out


def evaluate(model, params, task, ks):
  emb = jax.jit(model.apply)(params, jnp.asarray(task.x_test))
  return retrieval_metrics(np.asarray(emb), task.y_test, ks)


# ---------------------------------------------------------------- reports ----
_METRIC_KEYS = ("map", "recall@1", "recall@2", "recall@4", "recall@8")


def _summarise(per_seed):
  keys = [k for k in per_seed[0] if isinstance(per_seed[0][k], float)]
  return ({k: float(np.mean([r[k] for r in per_seed])) for k in keys},
          {k: float(np.std([r[k] for r in per_seed])) for k in keys})


def markdown_table(results):
  """The Table-1-style report: mean ± std over seeds, in percent."""
  cfg = results["config"]
  lines = [
      "# SOPRC retrieval results (issue 7)", "",
      f"Command: `{results['command']}`  ",
      f"Seeds: {list(cfg['seeds'])}; {cfg['train']['num_steps']} adam steps "
      f"(lr {cfg['train']['learning_rate']}) per run on class-balanced batches of "
      f"{cfg['train']['batch_size']} = {cfg['train']['batch_size'] // cfg['train']['samples_per_class']}"
      f" classes x {cfg['train']['samples_per_class']}; tower: MLP "
      f"{cfg['model']['hidden']} -> {cfg['model']['embed_dim']}, L2-normalised (cosine scores).  ",
      f"Machine: {results['machine']['platform']}, {results['machine']['cpu_count']} CPUs, "
      f"jax {results['machine']['jax']}; total {results.get('runtime_s', 0.0):.0f} s.", "",
      "mAUPRC = mean over test queries of the average precision of the ranking of all "
      "other test points (relevance = same category); R@k = fraction of queries with a "
      "same-category item among the k nearest. Values are mean ± std over seeds, in %. "
      "`train s` is wall time per run including compilation (shared across seeds).", ""]
  for task_name, task in results["tasks"].items():
    ks = [k for k in task["methods"]["untrained"]["mean"] if k.startswith("recall@")]
    lines += [f"## {task_name}", "", task["description"] + f"; {task['num_queries']} queries.", "",
              "| method | mAUPRC | " + " | ".join(k.replace("recall", "R") for k in ks)
              + " | train s |",
              "|---" * (len(ks) + 3) + "|"]
    for method, r in task["methods"].items():
      cells = [f"{100 * r['mean'][k]:.2f} ± {100 * r['std'][k]:.2f}" for k in ["map"] + ks]
      lines.append(f"| {method} | " + " | ".join(cells)
                   + f" | {r['mean'].get('train_time_s', 0.0):.1f} |")
    methods = task["methods"]
    if "soprc" in methods and "soprc_sg" in methods:
      diffs = [100 * (b["map"] - a["map"]) for a, b in
               zip(methods["soprc"]["per_seed"], methods["soprc_sg"]["per_seed"])]
      lines += ["", "Stop-gradient through h(x+) in the denominator (authors' code) minus "
                f"the paper's formula, mAUPRC per seed: {', '.join(f'{d:+.2f}' for d in diffs)}."]
    lines.append("")
  return "\n".join(lines)


# ------------------------------------------------------------------- main ----
def train_and_evaluate(config, workdir):
  """Runs every (task, method, seed), writes results.json and results.md."""
  for method in config.methods:
    if method not in METHODS:
      raise ConfigError("methods", f"unknown method {method!r}; choose from {METHODS}")
  workdir = pathlib.Path(workdir)
  (workdir / "runs").mkdir(parents=True, exist_ok=True)
  start = time.time()
  results = {"command": " ".join(["python -m experiments.auprc_retrieval"] + sys.argv[1:]),
             "config": config.to_dict(), "tasks": {},
             "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                         "jax": jax.__version__, "backend": jax.default_backend()}}
  tc = config.train
  for task_name in config.tasks:
    task = make_task(task_name, config)
    logging.info("task %s: %s", task_name, task.description)
    per_method = {}
    for method in ("untrained",) + tuple(config.methods):
      per_seed = []
      for seed in config.seeds:
        run_file = workdir / "runs" / f"{task_name}_{method}_{seed}.json"
        if run_file.exists():
          per_seed.append(json.loads(run_file.read_text()))
          continue
        t0 = time.time()
        if method == "untrained":
          model = EmbeddingTower(config.model.hidden, config.model.embed_dim)
          params = model.init(jax.random.key(seed), jnp.zeros((1, task.x_train.shape[1])))
          row = {"final_loss": float("nan")}
        else:
          sampler = auprc.ClassBalancedSampler(
              task.y_train, samples_per_class=tc.samples_per_class,
              batch_size=tc.batch_size, class_weighting=tc.class_weighting, seed=seed)
          batches = sampler.batches(0, tc.num_steps)  # the same batches for every method
          params, losses, model = train_one(method, config, task, seed, batches)
          row = {"first_loss": float(losses[:10].mean()), "final_loss": float(losses[-10:].mean())}
        row["train_time_s"] = time.time() - t0
        row.update(evaluate(model, params, task, tuple(config.eval.recall_ks)))
        row["seed"] = seed
        run_file.write_text(json.dumps(row))
        logging.info("%s %s seed %d: mAUPRC %.4f R@1 %.4f (%.1fs)", task_name, method, seed,
                     row["map"], row["recall@1"], row["train_time_s"])
        per_seed.append(row)
      mean, std = _summarise(per_seed)
      per_method[method] = {"per_seed": per_seed, "mean": mean, "std": std}
    results["tasks"][task_name] = {
        "description": task.description, "num_train": int(len(task.y_train)),
        "num_test": int(len(task.y_test)),
        "num_train_classes": int(task.y_train.max()) + 1,
        "num_queries": per_method["untrained"]["per_seed"][0]["num_queries"],
        "methods": per_method}
  results["runtime_s"] = time.time() - start
  out_dirs = [workdir] + ([pathlib.Path(config.results_dir)] if config.results_dir else [])
  for d in out_dirs:
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (d / "results.md").write_text(markdown_table(results))
  return results


def main(argv):
  del argv
  if not flags.FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  results = train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
  print(markdown_table(results))
  print(f"total {results['runtime_s']:.1f}s")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
