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
# hundreds of steps or thousands of vmapped draws then spends longer running than -O2 would have
# spent compiling. -O2, not -O3: test_exact_sampler's 20,000 vmapped draws (CPU seconds, 2026-11-28)
# compile in 1.1-1.3 s at -O2 against 3.9-5.9 s at -O3 and run as fast (2.9-3.3 s; 3.4-4.1 s at -O3,
# 8.5-9.6 s at -O0). Whether it pays depends on the program: test_trainer_theorem1's four fits (one
# scan of small steps) compile about as slowly at -O2 as at -O3, and run at -O0.
OPTIMIZED = {"xla_backend_optimization_level": 2}
