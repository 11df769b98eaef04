r"""Sharded train step: time per step with the class table on 1 vs 8 (forced CPU)
devices, and the bytes communicated per step.

  python -m benchmarks.sharded --out=/tmp/sharded.json            # K = 10^5, 10^6
  python -m benchmarks.sharded --small --out=/tmp/sharded.json    # a quick run

(`--size=small|full --out_dir=DIR`, as `benchmarks.run_all` passes them, also
work: DIR/sharded.json.) The step is `snm_jax.train.core.step.make_train_step` with
N=256, h=128, B=4096 shared uniform negatives in V=8 strata, SNM top-k (k=16,
BOWL, hinge), row-wise SGD on the table, and the tiny tower
`SNMTower(num_features=1024, hidden=h, out=h)` on random rows with nnz=16. Meshes
(data, model): (1, 1) on one device; (1, 8) and (2, 4) on 8 devices. The 8 CPU
"devices" share this machine's cores, so the 8-device time measures the cost of
sharding (collectives, smaller kernels), not a speed-up.

Bytes communicated per step, per device, with n = N/D local queries, D data
and M model shards, 4-byte floats/ints, 1-byte bools. A collective is counted
by the size of the buffer it leaves on each device (an all-reduce of x: |x|;
an all-gather: the gathered result):
  model axis (M > 1), inside the mined loss:
    * the merged top-k candidates: `all_gather_last_axis` (losses/topk.py) is a
      psum of an (n, M k) block per array. The loss needs the values (f32) and
      the valid flags (as i32); the ids are psum-ed too but unused by the loss,
      so XLA drops that psum (retrieval keeps it): 2 * 4 n M k;
    * psums of (n,) vectors: positive score and number of valid negatives (+ the
      tail sum when vartheta's tail is non-zero): 2 * 4 n. The hardest negative
      is the merged top-k's first entry, so it needs no pmax of its own;
    * backward: the query gradient (n, h) is summed over the model shards (the
      transpose of using the model-replicated queries in every shard), once for
      the positive and once for the negative scores: 2 * 4 n h;
  data axis (D > 1):
    * the data-parallel sum of the gathered rows' gradients, (B/M, h) per model
      shard: 4 B h / M;
    * the all-gathers in the update: positive rows' gradients (N, h), labels
      (N,) and "owned" flags (N,): 4 N h + 4 N + N;
    * the replicated tower's gradient: 4 |theta|;
  plus a handful of scalar all-reduces (loss, metrics), not in the formula.
None of these grows with K, and the model axis carries O(n M k + n h), not the
O(n B) of exchanging every sampled score (`naive_all_scores_bytes` = 4 n B, for
comparison). The "hlo" columns count the same way from the
collectives in the compiled program (what XLA actually runs, after combining
and simplifying); the JSON lists every one of them.
"""

from __future__ import annotations

import os

# Before jax is imported (also through benchmarks.common): 8 CPU devices.
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
os.environ["XLA_FLAGS"] = " ".join(_flags + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import common  # noqa: E402
from snm_jax import losses, sharding  # noqa: E402
from snm_jax.mining.samplers import StratifiedSampler  # noqa: E402
from snm_jax.models.towers import SNMTower  # noqa: E402
from snm_jax.train.core import row_optimizers  # noqa: E402
from snm_jax.train.core.step import LossSpec, TrainState, make_train_step  # noqa: E402



def _define_flags():
  """Defined only when run as a program (tests import this module beside other absl apps)."""
  flags.DEFINE_bool("small", False, "Quick run: small shapes, K in {10^4, 10^5}.")
  flags.DEFINE_string("out", None, "Path of the JSON report (default: <out_dir>/sharded.json).")
  flags.DEFINE_integer("reps", 0, "Timed steps per configuration (0: 10, or 5 with --small).")


@dataclasses.dataclass(frozen=True)
class Shape:
  n: int = 256              # Global minibatch N.
  h: int = 128              # Query / class width h (= the tower's hidden width).
  b: int = 4096             # Sampled negatives B, shared by the minibatch.
  k: int = 16               # Hardest negatives kept (mined top-k).
  num_strata: int = 8       # V (a multiple of every model size used).
  nnz: int = 16             # Non-zeros per input row.
  num_features: int = 1024  # Input dimension of the tower.
  label_width: int = 4      # Padded label-set width.


FULL = dict(shape=Shape(), ks=(10**5, 10**6), reps=10)
SMALL = dict(shape=Shape(n=64, h=32, b=512, k=8), ks=(10**4, 10**5), reps=5)
MESHES = ((1, 1), (1, 8), (2, 4))
TOWER_LR, TABLE_LR = 0.1, 0.5


# ---- communication: the formula ------------------------------------------------

def tower_param_count(s: Shape) -> int:
  return s.num_features * s.h + s.h * s.h + s.h


def formula_bytes(s: Shape, mesh_shape, tail_nonzero: bool = False) -> dict:
  """Bytes communicated per step per device (see the module docstring), by item."""
  d, m = mesh_shape
  n = s.n // d
  out = {}
  if m > 1:
    out["model/topk_candidates"] = 2 * 4 * n * m * s.k
    out["model/n_vectors"] = (3 if tail_nonzero else 2) * 4 * n
    out["model/query_grad"] = 2 * 4 * n * s.h
  if d > 1:
    out["data/row_grads"] = 4 * s.b * s.h // m
    out["data/update_gathers"] = 4 * s.n * s.h + 4 * s.n + s.n
    out["data/tower_grad"] = 4 * tower_param_count(s)
  out["total"] = sum(out.values())
  return out


# ---- communication: what the compiled program does ----------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.+?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|"
    r"all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[sfu]\d+|bf16)\[([\d,]*)\]")


def _shape_bytes(shape_text: str) -> tuple[int, int]:
  """(bytes of the non-scalar arrays, bytes of the scalars) of an HLO (tuple) shape."""
  arrays = scalars = 0
  for dtype, dims in _ARRAY.findall(shape_text):
    size = math.prod(int(x) for x in dims.split(",") if x) * _DTYPE_BYTES.get(dtype, 4)
    if dims:
      arrays += size
    else:
      scalars += size
  return arrays, scalars


def _group_size(line: str, num_devices: int) -> int:
  """Devices per replica group, from any of XLA's three spellings."""
  m = re.search(r"replica_groups=\{(\{[\d,]*\})", line)          # {{0,4},{1,5},...}
  if m:
    return len(m.group(1).strip("{}").split(","))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)        # [groups,size]<=[devices]
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # mesh['a'=2,...] {'a'}
  if m:
    sizes = dict((k.strip("'"), int(v)) for k, v in (a.split("=") for a in m.group(1).split(",")))
    return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip())
  return num_devices  # no groups: one group of all devices


def hlo_collectives(hlo_text: str, num_devices: int) -> list[dict]:
  """Every collective of a compiled (SPMD-partitioned) HLO module, with the bytes
  it leaves on each device (non-scalar arrays; scalars apart) and its group
  size. Only `-start` halves of async pairs match, so nothing is counted twice."""
  out = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.match(line)
    if not m:
      continue
    name = re.search(r'op_name="([^"]*)"', line)
    arrays, scalars = _shape_bytes(m.group("shape"))
    out.append({"op": m.group("op"), "bytes": arrays, "scalar_bytes": scalars,
                "group_size": _group_size(line, num_devices),
                "shape": m.group("shape")[:120], "op_name": name.group(1)[-120:] if name else ""})
  return [c for c in out if c["group_size"] > 1]


# ---- the step -------------------------------------------------------------------------



class ShardedStep:
  """The project's train step on one mesh, compiled, with its donated state."""

  def __init__(self, s: Shape, num_labels: int, mesh_shape, allocate: bool = True):
    devices = jax.devices()[:math.prod(mesh_shape)]
    mesh = sharding.make_mesh(mesh_shape, devices=devices)
    tower = SNMTower(num_features=s.num_features, hidden=s.h, out=s.h)
    params = tower.init(jax.random.key(0), jnp.zeros((1, s.nnz), jnp.int32),
                        jnp.zeros((1, s.nnz), jnp.float32))
    tx = optax.sgd(TOWER_LR)
    ropt = row_optimizers.sgd()
    sampler = StratifiedSampler(num_labels, s.b, num_strata=s.num_strata)
    head, tail = losses.split_vartheta(losses.top_k_vartheta(s.k, s.b, num_labels, scale="mean"))
    self.tail_nonzero = tail != 0.0
    spec = LossSpec(kind="bowl", phi=losses.hinge, tail=float(tail),
                    head_minus_tail=tuple(float(x - tail) for x in head))
    k_pad = sampler.padded_labels

    def init():
      return TrainState.create(params=params, opt_state=tx.init(params),
          table=common.hash_normal((k_pad, s.h)),
          table_state=ropt.init(k_pad, s.h))

    rep = sharding.named(mesh, sharding.REPLICATED)
    abstract = jax.eval_shape(init)
    shardings = jax.tree.map(lambda _: rep, abstract).replace(
        table=sharding.named(mesh, sharding.TABLE),
        table_state=jax.tree.map(lambda _: sharding.named(mesh, sharding.TABLE_ROWS), abstract.table_state))
    step = make_train_step(tower_apply=tower.apply, tx=tx, row_opt=ropt, table_lr=lambda _: TABLE_LR,
                           sampler=sampler, loss=spec, mesh=mesh, normalize_classes=True, donate=True)
    data = sharding.named(mesh, jax.P(sharding.DATA))
    self.batch = {k: jax.device_put(v, data) for k, v in common.random_batch(s, num_labels).items()}
    self.key = jax.random.key(1)
    abstract = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            abstract, shardings)
    self.compiled = step.lower(abstract, self.batch, self.key).compile()
    self.num_devices = len(devices)
    self.state = None
    if allocate:  # created sharded: no full table on one device
      self.state = jax.jit(init, out_shardings=shardings)()
      sharding.assert_table_sharded(self.state.table, mesh)

  def run(self):
    self.state, metrics = self.compiled(self.state, self.batch, self.key)
    return metrics

  def free(self):
    for x in jax.tree.leaves(self.state or ()):
      if isinstance(x, jax.Array) and not x.is_deleted():
        x.delete()
    self.state = None


def run(small: bool = False, reps: int = 0, meshes=MESHES) -> dict:
  cfg = SMALL if small else FULL
  s, reps = cfg["shape"], reps or cfg["reps"]
  rows, collectives = [], {}
  for num_labels in cfg["ks"]:
    steps = {m: ShardedStep(s, num_labels, m) for m in meshes}
    times = common.time_interleaved({m: st.run for m, st in steps.items()}, reps=reps)
    for m, st in steps.items():
      hlo = hlo_collectives(st.compiled.as_text(), st.num_devices)
      formula = formula_bytes(s, m, st.tail_nonzero)
      collectives[f"K={num_labels} mesh={m[0]}x{m[1]}"] = hlo
      rows.append({
          "K": num_labels, "mesh": f"{m[0]}x{m[1]}", "devices": st.num_devices,
          "step_ms": 1e3 * times[m]["median_s"], "min_ms": 1e3 * times[m]["min_s"],
          "reps": times[m]["reps"], "table_MiB_per_device": num_labels * s.h * 4 / m[1] / 2**20,
          "comm_bytes_formula": formula["total"],
          "comm_bytes_hlo": sum(c["bytes"] for c in hlo),
          "hlo_scalar_bytes": sum(c["scalar_bytes"] for c in hlo), "num_collectives_hlo": len(hlo),
          "comm_breakdown_formula": {k: v for k, v in formula.items() if k != "total"},
          # What exchanging all B sampled scores of the local queries would cost instead.
          "naive_all_scores_bytes": 4 * (s.n // m[0]) * s.b if m[1] > 1 else 0,
      })
      st.free()
  for r in rows:
    base = next(x for x in rows if x["K"] == r["K"] and x["mesh"] == "1x1")
    r["time_vs_1_device"] = r["step_ms"] / base["step_ms"]
  return {"shape": dataclasses.asdict(s), "rows": rows, "collectives": collectives}


def main(argv):
  del argv
  small = flags.FLAGS.small or (flags.FLAGS["size"].present and common.SIZE.value == "small")
  result = run(small=small, reps=flags.FLAGS.reps)
  columns = ["K", "mesh", "devices", "step_ms", "min_ms", "time_vs_1_device", "table_MiB_per_device",
             "comm_bytes_formula", "comm_bytes_hlo", "naive_all_scores_bytes"]
  notes = ["comm bytes: per device per step, the size of each collective's buffer "
           "(formula in benchmarks/sharded.py's docstring; hlo = counted in the compiled program)",
           "8 forced CPU devices share the same cores: the 8-device time is the cost of sharding"]
  payload = common.report(
      "sharded", "small" if small else "full",
      {**result["shape"], "meshes": [f"{d}x{m}" for d, m in MESHES], "row_optimizer": "sgd",
       "tower": "SNMTower(num_features, hidden=h, out=h)", "loss": "bowl hinge top-k, vartheta=1/k"},
      result["rows"], columns, None, notes, out_dir=None,
      extra={"collectives": result["collectives"]})
  out = pathlib.Path(flags.FLAGS.out or pathlib.Path(common.OUT_DIR.value) / "sharded.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(payload, indent=1, default=common._json_default) + "\n")  # pylint: disable=protected-access
  print(f"wrote {out}")


if __name__ == "__main__":
  _define_flags()
  common.run_main(main)
