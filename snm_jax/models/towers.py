"""Query towers. The class-embedding table is *not* part of these modules: it is
the object that gets sharded and sparsely updated, so the trainer owns it.

Inputs are padded sparse rows: ``feat_ids`` (N, nnz) int32 and ``feat_vals``
(N, nnz) float32 (padding has value 0), or, for `MLPTower`, dense rows
``features`` (N, d) float32; `tower_inputs(batch)` picks them out of a batch.

The input table of `EmbeddingBag` (d x hidden) is a flax parameter by default.
With a sparse input update (`model.input_update="sparse"`) the trainer owns it
like the class table (`snm_jax.train.core.input_table`) and passes the towers a
`bag_fn(feat_ids, feat_vals) -> (N, hidden)` that computes the bag from rows it
gathered: the module then never creates or reads its "embedding" parameter.

Compute dtype (`dtype`, config `model.dtype`; `snm_jax.models.precision`): the towers keep
float32 parameters (`param_dtype`) and compute their matmuls in `dtype` with float32
accumulation; their outputs are float32 queries, L2-normalised in float32 (the step's scores
multiply them with the class rows in the compute dtype again). An EmbeddingBag's gathered sum
(memory-bound, nnz terms) accumulates in float32 from the float32 table; its output is cast to
`dtype`. With the default float32 every tower computes exactly what it did before the field.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from snm_jax.models import precision
from snm_jax.models.dropout import Dropout


def l2_normalize(x, axis=-1, eps=1e-12):
  """x / ||x|| with a finite gradient at x = 0."""
  return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True) + eps)


def normalized_row_scores(q, rows, eps=1e-12, dtype=jnp.float32):
  """q (n, h) . l2_normalize(rows) (n, S, h) -> (n, S), each query against its own rows.

  The (n, S) scores are scaled instead of writing normalised (n, S, h) rows:
  the same values, ~3x faster where this is memory-bound (CPU). dtype: the products' factors
  are rounded to it and summed in float32 (`precision.einsum`); the row norms are float32.
  """
  return (precision.einsum("nh,nsh->ns", q, rows, dtype)
          * jax.lax.rsqrt(jnp.sum(jnp.square(rows), axis=-1) + eps))


def _dense_kwargs(dtype) -> dict:
  """nn.Dense arguments computing in `dtype` from float32 parameters with float32 accumulation;
  none for float32 (the layer then builds exactly its former program)."""
  if not precision.is_reduced(dtype):
    return {}
  return {"dtype": dtype, "param_dtype": jnp.float32,
          "dot_general": functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)}


# densify's flat index is int32: (N * width) must stay below this, else (row, column) pairs.
FLAT_INDEX_LIMIT = 2 ** 31


def densify(feat_ids, feat_vals, num_features: int, bias_column: bool = False):
  """Padded sparse rows (N, nnz) -> dense (N, d), or (N, d + 1) ending in a 1.0 column.

  Entries of value 0 (the padding) are not added but sent out of bounds and dropped by the scatter:
  rows are padded to the longest, so on Delicious 95% of the entries are padding, and XLA:CPU's
  scatter skips a dropped entry at a fraction of an added one's cost. Into one flat (N * width,)
  vector, so the scatter takes one linear index per entry rather than (row, column) pairs
  concatenated first (on 2 CPU cores, Delicious's (512, 320) rows: 0.6 ms against 1.1 ms). Same
  values: each (row, column) receives the same nonzeros."""
  n = feat_ids.shape[0]
  width = num_features + int(bias_column)
  keep = feat_vals != 0
  if n * width < FLAT_INDEX_LIMIT:
    flat = jnp.where(keep, jnp.arange(n, dtype=jnp.int32)[:, None] * width + feat_ids, n * width)
    dense = jnp.zeros((n * width,), feat_vals.dtype).at[flat.reshape(-1)].add(
        feat_vals.reshape(-1), mode="drop").reshape(n, width)
  else:
    rows = jnp.where(keep, jnp.arange(n, dtype=jnp.int32)[:, None], n)
    dense = jnp.zeros((n, width), feat_vals.dtype).at[rows, feat_ids].add(feat_vals, mode="drop")
  return dense.at[:, -1].set(1.0) if bias_column else dense


class EmbeddingBag(nn.Module):
  """sum_i v_i E[id_i]: a d x h linear layer applied to a sparse input. Shapes (N, nnz) -> (N, h).

  matmul="gather" (default): a gather of the N x nnz rows and a weighted sum;
  its cost does not depend on d, but its gradient is a scatter-add of N x nnz x h
  values (serial on XLA:CPU). matmul="dense": the input densified to (N, d)
  times the table, forward and backward plain matmuls of N x d x h -- the same
  values (summation order aside), several times faster while d is moderate
  (measured 6x fewer steps/s for the gather on Delicious, d = 500, on 2 CPU
  cores), hopeless for d in the 10^5s.

  bag_fn: if given, `bag_fn(feat_ids, feat_vals)` (N, h) is the output and the
  "embedding" parameter is neither created nor read: the caller holds the table
  and computes the same sum (the train step's sparse input update,
  `snm_jax.train.core.input_table`). The values it was called with are then sown as
  "values" in the "intermediates" collection (kept only when the caller passes
  `mutable=["intermediates"]`): the row gradients are those values times the
  gradient of the bag.

  dtype: the output's (the compute dtype). The gathered sum accumulates in `param_dtype`
  (float32) from the float32 table; the dense-matmul bag multiplies in `dtype` with float32
  accumulation (`precision.matmul`).
  """
  num_features: int
  features: int
  dtype: Any = jnp.float32
  matmul: str = "gather"
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, feat_ids, feat_vals, bag_fn=None, densified=None):
    """densified: optional `densify(feat_ids, feat_vals)` (N, d) already built by the caller
    (WideDeepQuery's wide path), used by matmul="dense" instead of densifying a second time."""
    if bag_fn is not None:
      feat_vals = feat_vals.astype(self.param_dtype)
      self.sow("intermediates", "values", feat_vals)
      return bag_fn(feat_ids, feat_vals).astype(self.dtype)
    table = self.param("embedding", nn.initializers.normal(stddev=self.features ** -0.5),
                       (self.num_features, self.features), self.param_dtype)
    feat_vals = feat_vals.astype(self.param_dtype)
    if self.matmul == "dense":
      x = densify(feat_ids, feat_vals, self.num_features) if densified is None else densified
      return precision.matmul(x, table, self.dtype).astype(self.dtype)
    return jnp.einsum("bn,bnh->bh", feat_vals, jnp.take(table, feat_ids, axis=0)).astype(self.dtype)


def feature_dropout(rate: float, feat_vals, train: bool):
  """Drops each input nonzero (an entry of the padded `feat_vals`) with
  probability `rate` and scales the kept ones by 1 / (1 - rate) (inverted
  dropout: the expected input is unchanged). Identity when not training or at
  rate 0 (no rng drawn). Call it inside a compact method: it uses that module's "dropout"
  rng stream."""
  return Dropout(rate, deterministic=not train, name="input_dropout")(feat_vals)


class SNMTower(nn.Module):
  """The embedding model of Reddi et al. (2019), Sec. 6:
  x -> EmbeddingBag(d -> hidden) -> ReLU -> Dense(hidden -> out) -> L2-normalise.
  Scores against L2-normalised class rows are cosines in [-1, 1].

  Use it for large d: its parameters are O(d hidden) and the class table is
  K x out, independent of d (the linear / wide-and-deep queries need a
  K x (d + 1) table).

  dropout: rate of dropout on the bag output (after the ReLU); feature_dropout:
  rate at which input nonzeros are dropped (inverted scaling). Both act only
  when called with `train=True` and an rng for the "dropout" collection
  (`apply(params, ids, vals, train=True, rngs={"dropout": key})`); the default
  call `apply(params, ids, vals)` is deterministic (evaluation). At rate 0 no
  rng is drawn.

  bag_fn: `EmbeddingBag`'s (the input table held outside the module); it is
  called with the feature values after feature dropout.

  dtype: the compute dtype (module docstring); the output is float32.
  """
  num_features: int
  hidden: int = 512
  out: int = 512
  normalize: bool = True
  dropout: float = 0.0
  feature_dropout: float = 0.0
  bag_matmul: str = "gather"   # EmbeddingBag.matmul
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, feat_ids, feat_vals, train: bool = False, bag_fn=None, densified=None):
    feat_vals = feature_dropout(self.feature_dropout, feat_vals, train)
    h = nn.relu(EmbeddingBag(self.num_features, self.hidden, matmul=self.bag_matmul, dtype=self.dtype,
                             name="bag")(feat_ids, feat_vals, bag_fn=bag_fn, densified=densified))
    h = Dropout(self.dropout, deterministic=not train, name="bag_dropout")(h)
    q = nn.Dense(self.out, name="proj", **_dense_kwargs(self.dtype))(h).astype(jnp.float32)
    return l2_normalize(q) if self.normalize else q


class LinearQuery(nn.Module):
  """Bamler & Mandt's linear model xi_y(x) = x^T w_y + b_y, written as
  q(x) = [x, 1] so that the class row [w_y, b_y] holds weight and bias.
  Output (N, d + 1). No parameters: all of the model is the class table.

  The query is dense in d, so the class table is K x (d + 1) and scoring costs
  O(d) per (example, class): use it for moderate d only (for large d use
  SNMTower, whose table width does not depend on d). Its class rows start at 0
  and must not be L2-normalised at scoring (model.normalize_classes resolves to
  False). feature_dropout as in SNMTower (train=True only).
  """
  num_features: int
  feature_dropout: float = 0.0

  @nn.compact
  def __call__(self, feat_ids, feat_vals, train: bool = False):
    feat_vals = feature_dropout(self.feature_dropout, feat_vals, train)
    return densify(feat_ids, feat_vals, self.num_features, bias_column=True)


class WideDeepQuery(nn.Module):
  """Wide and deep: q(x) = [x, 1, tower(x)], output (N, d + 1 + out).

  A class row [w_y, b_y, e_y] then scores w_y.x + b_y + e_y.tower(x): a sparse
  linear model (the "wide" path, LinearQuery) plus the SNM tower (the "deep"
  path), summed. Like the linear model it needs a K x (d + 1 + out) table, so
  it is for moderate d (the linear path memorises feature-class pairs the
  tower's bottleneck may miss); for large d use SNMTower alone. Class rows
  start at 0 and are not L2-normalised (model.normalize_classes resolves to
  False); the tower's output is L2-normalised as in SNMTower.

  feature_dropout drops input nonzeros once, before both paths (the same mask
  for both); dropout acts on the tower's bag output. Both only with train=True.
  bag_fn: the tower's (`SNMTower`). dtype: the tower's compute dtype; the wide path is the
  float32 input (the step's scores round both paths to the compute dtype).
  """
  num_features: int
  hidden: int = 512
  out: int = 512
  dropout: float = 0.0
  feature_dropout: float = 0.0
  bag_matmul: str = "gather"   # EmbeddingBag.matmul of the tower
  dtype: Any = jnp.float32

  @property
  def constant_query_columns(self) -> int:
    """The query's leading columns that depend on no parameter, [x, 1]: the train step does not
    differentiate them (`snm_jax.train.core.step`)."""
    return self.num_features + 1

  @nn.compact
  def __call__(self, feat_ids, feat_vals, train: bool = False, bag_fn=None):
    feat_vals = feature_dropout(self.feature_dropout, feat_vals, train)
    # The wide path's x, densified once: the tower's dense-matmul bag multiplies the same (N, d)
    # rows. One scatter fewer in the compiled step (an XLA trace put the second at ~0.8 ms); the
    # end-to-end step time was within noise in an interleaved A/B, the state bit-identical.
    x = densify(feat_ids, feat_vals, self.num_features)
    shared = x if (self.bag_matmul == "dense" and bag_fn is None
                   and feat_vals.dtype == jnp.float32) else None
    deep = SNMTower(self.num_features, hidden=self.hidden, out=self.out, dropout=self.dropout,
                    bag_matmul=self.bag_matmul, dtype=self.dtype, name="tower")(
                        feat_ids, feat_vals, train=train, bag_fn=bag_fn, densified=shared)
    return jnp.concatenate([x, jnp.ones((x.shape[0], 1), x.dtype), deep], axis=-1)


def tower_inputs(batch) -> tuple:
  """The positional inputs of a query tower in a batch of the input pipeline.

  (batch["features"],) (N, d) for dense batches (`snm_jax.data.pipeline.DenseBatcher`),
  else (batch["feat_ids"], batch["feat_vals"]) (N, nnz) (`SparseBatcher`). The train step
  and the evaluator both call `tower_apply(params, *tower_inputs(batch))`. The choice is on
  the dict's keys, so it is static under jit.
  """
  if "features" in batch:
    return (batch["features"],)
  return (batch["feat_ids"], batch["feat_vals"])


class MLPTower(nn.Module):
  """A tower over dense inputs (image or text embeddings):
  x (N, d) -> [Dense(hidden) -> ReLU -> dropout] x num_hidden_layers -> Dense(out) -> L2-normalise
  -> (N, out). Against L2-normalised class rows its scores are cosines in [-1, 1], as SNMTower's.

  num_hidden_layers = 0 is a linear map then L2. feature_dropout drops input entries
  (inverted scaling, as in SNMTower), dropout acts after each hidden ReLU; both only with
  `apply(params, x, train=True, rngs={"dropout": key})`. The default call is deterministic.

  The classification task's `model.kind="mlp"`; with num_hidden_layers=1 and no dropout it is
  also the retrieval task's tower (`EmbeddingTower`). dtype: the compute dtype of the Dense
  layers (module docstring); the output is float32.
  """
  hidden: int
  out: int
  num_hidden_layers: int = 1
  dropout: float = 0.0
  feature_dropout: float = 0.0
  normalize: bool = True
  dtype: Any = jnp.float32

  def layer_name(self, i: int) -> str:
    """Name of hidden layer i (0-based), or of the output layer for i = num_hidden_layers."""
    return "proj" if i == self.num_hidden_layers else f"hidden_{i}"

  @nn.compact
  def __call__(self, x, train: bool = False):
    h = feature_dropout(self.feature_dropout, x, train)
    for i in range(self.num_hidden_layers):
      h = nn.relu(nn.Dense(self.hidden, name=self.layer_name(i), **_dense_kwargs(self.dtype))(h))
      h = Dropout(self.dropout, deterministic=not train, name=f"dropout_{i}")(h)
    q = nn.Dense(self.out, name=self.layer_name(self.num_hidden_layers),
                 **_dense_kwargs(self.dtype))(h).astype(jnp.float32)
    if not self.normalize:
      return q
    # l2_normalize's value, written with q * q instead of jnp.square(q): the retrieval task's
    # tower always computed it so, and the two differ in the gradient's last bits.
    return q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + 1e-12)


class EmbeddingTower(MLPTower):
  """The retrieval task's tower (config.task="retrieval"): `MLPTower(hidden, out)`, x (N, d)
  -> Dense -> ReLU -> Dense -> L2 normalise -> (N, out); scores are cosines in [-1, 1].

  Only the layer names differ: they are the ones flax gave this tower's layers before it was
  an MLPTower (the output layer "Dense_0", the hidden one "Dense_1"). A layer's initial
  values are drawn from a key of its name, so these names keep the retrieval runs' bits and
  checkpoints unchanged.
  """

  def layer_name(self, i: int) -> str:
    return "Dense_0" if i == self.num_hidden_layers else f"Dense_{i + 1}"
