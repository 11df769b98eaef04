r"""The snm-jax train step against a PyTorch eager step of the same algorithm, timed interleaved.

  python -m benchmarks.peers --size=full --out_dir=/tmp/snm_jax_bench
  python -m benchmarks.peers --size=small   # seconds: a smaller d and K, the same code

Workload (`Workload`, the issue's): N = 256 rows of nnz = 64 sparse features out of d = 200,000,
an SNM tower EmbeddingBag(d -> 512) -> ReLU -> Dense(512 -> 128) -> L2, L2-normalised class rows
(h = 128) of K = 10^5 or 10^6 labels, B = 4,096 negatives shared by the minibatch (uniform, in
V = 8 strata, with replacement), the top-16 BOWL hinge (relu(1 - v_y) + mean of relu(1 + v_j)
over the 16 hardest valid negatives), plain SGD: lr 0.1 for the tower (input table included),
0.5 for the class table. Contestants, each on the same random batch and the same initial
parameters:

  * snm_jax_sparse_input: `snm_jax.train.core.step.make_train_step` with the input table held outside
    the tower (`model.input_update="sparse"`, `snm_jax.train.core.input_table`): row SGD on the
    N x nnz touched input rows and on the drawn and positive class rows; (1, 1) mesh, state donated;
  * snm_jax_dense_input: the same step with the input table a flax parameter
    (`model.input_update="dense"`): its d x 512 gradient and the optax update of all d rows;
  * torch_threads1, torch_threads2: PyTorch eager, `nn.EmbeddingBag(mode="sum", sparse=True)`
    with per-sample weights, `nn.Linear`, a sparse `nn.Embedding` class table, `torch.topk` of
    the (N, B) scores computed without gradient and the 16 selected rows re-scored with gradient
    (the snm-jax step's O(N k h) backward, `losses.sampled.ordered_weighted_loss`'s `score_at`),
    `torch.optim.SGD` (sparse gradients for both tables); negatives drawn with `torch.randint`
    per stratum; with 1 and with 2 intra-op threads (`torch.set_num_threads` before each call:
    on a loaded machine torch's OpenMP threads lose far more to contention than one thread
    gains, on a quiet one two are faster), each its own copy of the parameters. Targets
    compare with the faster of the two (`torch_best`);
  * matmul: the float32 4096^3 matmul of `benchmarks.common`, the machine's peak in the same rounds.

The input-dimension sweep (`run_input_sweep`, `summary.input_sweep`): the snm-jax sparse-input step
and the torch steps on benchmarks/step_scaling.py's input-sweep workload (K = 10^4, tower width 128)
at d = 10^4, 10^5, 10^6, all in the same rounds: each one's t(10^6) / t(10^4), torch's being the
reference for what this machine's memory system costs as the touched rows spread over a larger table.

The snm-jax sparse step, the torch steps and the matmul share rounds; the dense-input step is
timed in rounds of its own (it writes GBs per step and would slow whatever follows it).

Before timing, both implementations take one step from the same parameters on the same batch
and the same negative ids (the snm-jax sampler's draws for the step's key, handed to torch):
their losses must agree to 1e-5 and the updated parameters (input table, projection, class
table) to 1e-5; the benchmark stops otherwise. Times: medians of `reps` steps, one step of
each contestant per round in rotating order (`common.time_interleaved`), so the ratios hold on
a loaded machine; the load average is recorded. torch is an optional extra (`.[peers]`); without
it the torch rows are skipped with a note.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common
from snm_jax import losses, sharding
from snm_jax.mining.samplers import StratifiedSampler
from snm_jax.models.towers import SNMTower
from snm_jax.train.core import row_optimizers
from snm_jax.train.core.input_table import InputTable, split_params
from snm_jax.train.core.step import LossSpec, SparseInputTrainState, TrainState, make_train_step

try:
  import torch  # pylint: disable=g-import-not-at-top
except ImportError:  # the optional `peers` extra
  torch = None


@dataclasses.dataclass(frozen=True)
class Workload:
  n: int = 256              # Minibatch N.
  nnz: int = 64             # Features per row.
  num_features: int = 200_000  # d.
  hidden: int = 512         # EmbeddingBag width.
  h: int = 128              # Query / class width.
  b: int = 4096             # Shared negatives B.
  k: int = 16               # Hardest negatives kept.
  num_strata: int = 8       # V.
  label_width: int = 4      # Padded label-set width.
  tower_lr: float = 0.1
  table_lr: float = 0.5


SIZES = {
    "small": dict(workload=Workload(num_features=20_000, b=1024), ks=(10**4,), reps=10,
                  input_ds=(10**3, 10**4)),
    "full": dict(workload=Workload(), ks=(10**5, 10**6), reps=20, input_ds=(10**4, 10**5, 10**6)),
}
# The input-dimension sweep (`run_input_sweep`): the workload of benchmarks/step_scaling.py's input
# sweep (K = 10^4, tower 128 -> 128, nnz 64, B = 4,096, k = 16), d varied, the snm-jax sparse-input
# step and PyTorch's sparse EmbeddingBag step timed in the same rounds: torch's own t(d_max) / t(d_min)
# is the reference for snm-jax's (issue 17's target <= 1.2), i.e. how much of the growth with d is
# this machine's memory system (the touched rows' cache and TLB misses) rather than either step.
INPUT_SWEEP_K = 10**4
INPUT_SWEEP_WORKLOAD = Workload(hidden=128)
TORCH_THREADS = (1, 2)
LOSS_TOL = 1e-5
PARAM_TOL = 1e-5
EPS = 1e-12  # the L2 normalisation's, `snm_jax.models.towers.l2_normalize`


def loss_spec(w: Workload, num_labels: int) -> LossSpec:
  head, tail = losses.split_vartheta(losses.top_k_vartheta(w.k, w.b, num_labels, scale="mean"))
  return LossSpec(kind="bowl", phi=losses.hinge, head_minus_tail=tuple(float(x - tail) for x in head),
                  tail=float(tail))


def initial_params(w: Workload, num_labels: int) -> dict:
  """NumPy float32 parameters both implementations start from: the tower's flax init (its input
  table replaced by hash-filled rows of the same scale, no d x 512 random temporaries) and
  hash-filled class rows."""
  tower = SNMTower(num_features=1, hidden=w.hidden, out=w.h)
  dense, _ = split_params(tower.init(jax.random.key(0), jnp.zeros((1, w.nnz), jnp.int32),
                                     jnp.zeros((1, w.nnz), jnp.float32)))
  k_pad = StratifiedSampler(num_labels, w.b, num_strata=w.num_strata).padded_labels
  return {"input_table": np.asarray(common.hash_normal((w.num_features, w.hidden), seed=3)
                                    * np.float32(w.hidden ** -0.5)),
          "proj_kernel": np.asarray(dense["params"]["proj"]["kernel"]),
          "proj_bias": np.asarray(dense["params"]["proj"]["bias"]),
          "class_table": np.asarray(common.hash_normal((k_pad, w.h), seed=4))}


class JaxStep:
  """The project step on a (1, 1) mesh with the input table sparse or dense (a flax parameter)."""

  def __init__(self, w: Workload, num_labels: int, params: dict, *, sparse: bool, donate: bool = True):
    self.mesh = sharding.make_mesh((1, 1), devices=jax.devices()[:1])
    self.tower = SNMTower(num_features=w.num_features, hidden=w.hidden, out=w.h)
    self.sampler = StratifiedSampler(num_labels, w.b, num_strata=w.num_strata)
    tx, ropt = optax.sgd(w.tower_lr), row_optimizers.sgd()
    in_table = (InputTable(mesh=self.mesh, row_opt=row_optimizers.sgd(), lr=lambda _: w.tower_lr)
                if sparse else None)
    dense = {"params": {"proj": {"kernel": params["proj_kernel"], "bias": params["proj_bias"]}}}
    rep = sharding.named(self.mesh, sharding.REPLICATED)
    put = lambda x: jax.device_put(x, rep)  # noqa: E731
    if sparse:
      self.state = SparseInputTrainState.create(
          params=jax.tree.map(put, dense), opt_state=tx.init(dense), table=put(params["class_table"]),
          table_state={}, input_table=put(params["input_table"]), input_table_state={})
    else:
      full = {"params": {**dense["params"], "bag": {"embedding": params["input_table"]}}}
      self.state = TrainState.create(params=jax.tree.map(put, full), opt_state=tx.init(full),
                                     table=put(params["class_table"]), table_state={})
    self.state = jax.device_put(self.state, rep)
    self.step = make_train_step(tower_apply=self.tower.apply, tx=tx, row_opt=ropt,
                                table_lr=lambda _: w.table_lr, sampler=self.sampler,
                                loss=loss_spec(w, num_labels), mesh=self.mesh, normalize_classes=True,
                                donate=donate, input_table=in_table)
    self.w = w

  def device_batch(self, batch: dict) -> dict:
    data = sharding.named(self.mesh, jax.P(sharding.DATA))
    return {k: jax.device_put(v, data) for k, v in batch.items()}

  def negatives(self, key) -> np.ndarray:
    """The B ids the step draws for `key` (on one device every stratum is drawn by one shard)."""
    return np.asarray(self.sampler.sample_strata(key, jnp.arange(self.w.num_strata))[0])

  def params(self) -> dict:
    p = self.state.params["params"]
    table = (self.state.input_table if isinstance(self.state, SparseInputTrainState)
             else p["bag"]["embedding"])
    return {"input_table": np.asarray(table), "proj_kernel": np.asarray(p["proj"]["kernel"]),
            "proj_bias": np.asarray(p["proj"]["bias"]), "class_table": np.asarray(self.state.table)}

  def free(self):
    jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) and not x.is_deleted() else None,
                 self.state)


class TorchStep:
  """The same algorithm in PyTorch eager (module docstring)."""

  def __init__(self, w: Workload, num_labels: int, params: dict, seed: int = 0):
    nn = torch.nn
    self.w, self.num_labels = w, num_labels
    self.k_pad = params["class_table"].shape[0]
    self.bag = nn.EmbeddingBag(w.num_features, w.hidden, mode="sum", sparse=True)
    self.proj = nn.Linear(w.hidden, w.h)
    self.classes = nn.Embedding(self.k_pad, w.h, sparse=True)
    with torch.no_grad():
      self.bag.weight.copy_(torch.tensor(params["input_table"]))
      self.proj.weight.copy_(torch.tensor(params["proj_kernel"].T))
      self.proj.bias.copy_(torch.tensor(params["proj_bias"]))
      self.classes.weight.copy_(torch.tensor(params["class_table"]))
    self.opt = torch.optim.SGD([
        {"params": [self.bag.weight, self.proj.weight, self.proj.bias], "lr": w.tower_lr},
        {"params": [self.classes.weight], "lr": w.table_lr}])
    self.gen = torch.Generator().manual_seed(seed)
    per = w.b // w.num_strata
    self.offsets = torch.arange(w.num_strata).repeat_interleave(per) * (self.k_pad // w.num_strata)

  @staticmethod
  def _l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + EPS)

  def draw(self):
    """B shared negatives: B / V uniform draws with replacement in each stratum's rows."""
    return self.offsets + torch.randint(0, self.k_pad // self.w.num_strata, (self.w.b,), generator=self.gen)

  def step(self, batch: dict, neg_ids=None) -> float:
    w = self.w
    neg_ids = self.draw() if neg_ids is None else neg_ids
    self.opt.zero_grad(set_to_none=True)
    hidden = torch.relu(self.bag(batch["feat_ids"], per_sample_weights=batch["feat_vals"]))
    q = self._l2(self.proj(hidden))
    rows = self.classes(neg_ids)                                  # (B, h), raw
    pos = (q * self._l2(self.classes(batch["label"]))).sum(-1)
    with torch.no_grad():  # rank only: the gradient reaches the k selected rows
      scores = q @ self._l2(rows).T
      invalid = (neg_ids[None, :, None] == batch["label_set"][:, None, :]).any(-1) | (neg_ids >= self.num_labels)
      scores.masked_fill_(invalid, float("-inf"))
      top, idx = torch.topk(scores, w.k, dim=1)
      top_valid = torch.isfinite(top)
    picked = rows[idx]                                            # (N, k, h), differentiable
    s = torch.einsum("nh,nkh->nk", q, picked) * torch.rsqrt((picked * picked).sum(-1) + EPS)
    per_ex = torch.relu(1.0 - pos) + torch.where(top_valid, torch.relu(1.0 + s), 0.0).sum(-1) / w.k
    valid = batch["valid"].to(per_ex.dtype)
    loss = (per_ex * valid).sum() / valid.sum().clamp(min=1.0)
    loss.backward()
    self.opt.step()
    return loss.detach()

  def params(self) -> dict:
    return {"input_table": self.bag.weight.detach().numpy(),
            "proj_kernel": self.proj.weight.detach().numpy().T, "proj_bias": self.proj.bias.detach().numpy(),
            "class_table": self.classes.weight.detach().numpy()}


def torch_batch(batch: dict) -> dict:
  return {"feat_ids": torch.from_numpy(batch["feat_ids"].astype(np.int64)),
          "feat_vals": torch.from_numpy(batch["feat_vals"]),
          "label": torch.from_numpy(batch["label"].astype(np.int64)),
          "label_set": torch.from_numpy(batch["label_set"].astype(np.int64)),
          "valid": torch.from_numpy(batch["valid"])}


def check_same_step(w: Workload, num_labels: int, params: dict, batch: dict) -> dict:
  """One step of each implementation from `params` on `batch` with the same negatives: the
  losses and the updated parameters' max abs differences (raises if above LOSS_TOL / PARAM_TOL)."""
  ref = JaxStep(w, num_labels, params, sparse=True, donate=False)
  key = jax.random.key(11)
  ref.state, metrics = ref.step(ref.state, ref.device_batch(batch), key)
  t = TorchStep(w, num_labels, params)
  t_loss = float(t.step(torch_batch(batch), torch.from_numpy(ref.negatives(key).astype(np.int64))))
  out = {"loss_snm_jax": float(metrics["loss"]), "loss_torch": t_loss,
         "loss_abs_diff": abs(float(metrics["loss"]) - t_loss)}
  got, want = t.params(), ref.params()
  for name in want:
    out[f"{name}_max_abs_diff"] = float(np.max(np.abs(got[name] - want[name])))
    out[f"{name}_max_abs_update"] = float(np.max(np.abs(want[name] - params[name])))
  ref.free()
  del t
  if out["loss_abs_diff"] > LOSS_TOL or any(out[f"{n}_max_abs_diff"] > PARAM_TOL for n in want):
    raise AssertionError(f"snm-jax and torch disagree on one step: {out}")
  return out


def _jax_call(js: JaxStep, batch: dict):
  """One step of `js` on `batch` (key 1), its state carried over: a contestant of the rounds."""
  args = (js.device_batch(batch), jax.random.key(1))

  def call():
    js.state, metrics = js.step(js.state, *args)
    return js.state, metrics
  return call


def _torch_calls(w: Workload, num_labels: int, params: dict, batch: dict) -> dict:
  """{"torch_threads<t>": one eager step with t intra-op threads} for each of TORCH_THREADS, each its
  own copy of `params`; {} without torch."""
  if torch is None:
    return {}
  tb, out = torch_batch(batch), {}
  for threads in TORCH_THREADS:
    def call(ts=TorchStep(w, num_labels, params), threads=threads):
      torch.set_num_threads(threads)
      return ts.step(tb).item()  # eager on CPU: done when it returns
    out[f"torch_threads{threads}"] = call
  return out


def run_k(w: Workload, num_labels: int, reps: int) -> tuple[list, dict, dict]:
  """Checks, then times every contestant at one K; returns (rows, check, interleaved peak)."""
  params = initial_params(w, num_labels)
  batch = common.random_batch(w, num_labels)
  check = check_same_step(w, num_labels, params, batch) if torch is not None else {
      "skipped": "torch not installed (pip install -e '.[peers]')"}
  fns, keep = {}, {}
  for name, sparse in (("snm_jax_sparse_input", True), ("snm_jax_dense_input", False)):
    keep[name] = JaxStep(w, num_labels, params, sparse=sparse)
    fns[name] = _jax_call(keep[name], batch)
  fns.update(_torch_calls(w, num_labels, params, batch))
  fns["matmul"], mm_flops = common.matmul_fn()
  threads0 = torch.get_num_threads() if torch is not None else None
  # The dense-input step in rounds of its own: it writes GBs per step (the d x 512 gradient,
  # optax on all d rows), which would slow whatever runs after it in a shared round.
  dense = {"snm_jax_dense_input": fns.pop("snm_jax_dense_input")}
  times = {**common.time_interleaved(fns, reps=reps), **common.time_interleaved(dense, reps=reps // 2)}
  if torch is not None:
    torch.set_num_threads(threads0)
  peak = common.peak_from_times(times.pop("matmul"), mm_flops)
  rows = [{"contestant": name, "K": num_labels, "time_ms": 1e3 * t["median_s"], "min_ms": 1e3 * t["min_s"],
           "max_ms": 1e3 * t["max_s"], "reps": t["reps"]} for name, t in times.items()]
  torch_ms = [r["time_ms"] for r in rows if r["contestant"].startswith("torch")]
  for r in rows:
    r["over_torch_best"] = r["time_ms"] / min(torch_ms) if torch_ms else None
  for js in keep.values():
    js.free()
  return rows, check, peak


def run_input_sweep(w: Workload, ds, num_labels: int, reps: int) -> tuple[list, dict]:
  """The snm-jax sparse-input step and the torch steps at every d of `ds`, all timed in the same
  rounds; returns (rows, {contestant: t(max d) / t(min d)})."""
  fns, keep = {}, []
  for d in ds:
    wd = dataclasses.replace(w, num_features=d)
    params, batch = initial_params(wd, num_labels), common.random_batch(wd, num_labels)
    keep.append(JaxStep(wd, num_labels, params, sparse=True))
    fns[("snm_jax_sparse_input", d)] = _jax_call(keep[-1], batch)
    fns.update({(name, d): fn for name, fn in _torch_calls(wd, num_labels, params, batch).items()})
    del params
  threads0 = torch.get_num_threads() if torch is not None else None
  times = common.time_interleaved(fns, reps=reps)
  if torch is not None:
    torch.set_num_threads(threads0)
  for js in keep:
    js.free()
  rows = [{"contestant": name, "d": d, "K": num_labels, "time_ms": 1e3 * t["median_s"],
           "min_ms": 1e3 * t["min_s"], "max_ms": 1e3 * t["max_s"], "reps": t["reps"]}
          for (name, d), t in times.items()]
  at = {(r["contestant"], r["d"]): r["time_ms"] for r in rows}
  lo, hi = min(ds), max(ds)
  ratios = {name: at[(name, hi)] / at[(name, lo)] for name, d in at if d == lo}
  return rows, {"d": (hi, lo), "time_ratio": ratios}


def run(size: str = "small", out_dir: str | None = None) -> dict:
  cfg = SIZES[size]
  w = cfg["workload"]
  if torch is not None:
    torch.manual_seed(0)
  load_before = [round(x, 2) for x in os.getloadavg()]
  rows, checks, peaks = [], {}, {}
  for k in cfg["ks"]:
    r, checks[k], peaks[k] = run_k(w, k, cfg["reps"])
    rows += r
  summary = {}
  for k in cfg["ks"]:
    ratio = next((r["over_torch_best"] for r in rows
                  if r["K"] == k and r["contestant"] == "snm_jax_sparse_input"), None)
    if ratio is not None:
      summary[f"target_K{k}"] = {"snm_jax_over_torch": ratio, "target": "<= 1.0", "met": ratio <= 1.0,
                                 "stretch": "<= 0.8", "stretch_met": ratio <= 0.8}
  input_rows, summary["input_sweep"] = run_input_sweep(INPUT_SWEEP_WORKLOAD, cfg["input_ds"], INPUT_SWEEP_K,
                                                       cfg["reps"])
  notes = [] if torch is not None else ["torch not installed: only the snm-jax steps were timed"]
  return common.report(
      "peers", size, {**dataclasses.asdict(w), "ks": cfg["ks"], "reps": cfg["reps"], "input_ds": cfg["input_ds"],
                      "torch": getattr(torch, "__version__", None),
                      "torch_threads": TORCH_THREADS if torch is not None else None},
      rows, ["contestant", "K", "time_ms", "min_ms", "max_ms", "over_torch_best"],
      {"gflops": min(p["gflops"] for p in peaks.values()), "per_K": peaks,
       "source": "the matmul timed in the same rounds"}, notes, out_dir,
      extra={"summary": summary, "same_step_check": checks, "input_sweep_rows": input_rows,
             "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]}})


def main(argv):
  del argv
  payload = run(common.SIZE.value, common.OUT_DIR.value)
  print("same-step check:", payload["same_step_check"])
  print("summary:", payload["summary"], "load average:", payload["load_average"])


if __name__ == "__main__":
  common.run_main(main)
