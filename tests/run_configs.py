"""The small training runs the tests launch: `experiments/configs/default.py:paper,runlocal` (a plain run,
the papers' settings shrunk) plus dotted overrides."""

from experiments.configs import default, xmc
from snm_jax.train.config.overrides import apply_overrides


def runlocal(overrides=None, **more):
  """default.py:paper,runlocal with the dotted `overrides` and then `more` ({"section.field": value} each)."""
  return apply_overrides(default.get_config("paper,runlocal"),
                         {**(overrides or {}), **more})


def synthetic(num_labels: int, num_train: int, num_test: int, dim: int, overrides=None):
  """A runlocal run on the synthetic generator, one device, no evaluation or checkpoints unless
  `overrides` ask for them."""
  base = {"dataset.name": "synthetic", "dataset.synthetic.num_labels": num_labels,
          "dataset.synthetic.num_train": num_train, "dataset.synthetic.num_test": num_test,
          "dataset.synthetic.dim": dim, "mesh.shape": (1, 1), "train.eval_every": 0,
          "train.checkpoint_every": 0, "eval.max_examples": 0}
  return runlocal({**base, **(overrides or {})})


def tiny_synthetic_recipe(num_train=800, num_test=100, **fields):
  """The xmc recipe (runlocal) on a 64-label synthetic problem, with `fields` ({"recipe.search": ...})."""
  c = xmc.get_config("synthetic,runlocal")
  c.unlock()
  apply_overrides(c, {"dataset.synthetic.num_labels": 64, "dataset.synthetic.num_train": num_train,
                      "dataset.synthetic.num_test": num_test, "dataset.synthetic.dim": 16, **fields})
  c.lock()
  return c


# `jax.jit(..., compiler_options=OPTIMIZED)` for a test's own long loop: the suite compiles at
# LLVM -O0 (conftest.FAST_COMPILE_FLAGS), right for programs run a few times, but a program run for
# hundreds of steps or thousands of vmapped draws then spends longer running than -O3 would have
# spent compiling (test_trainer_theorem1's four fits: 12 s at -O3 against 26 s).
OPTIMIZED = {"xla_backend_optimization_level": 3}
