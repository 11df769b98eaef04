r"""SOPRC retrieval: SOPRC vs AP loss, Smooth-AP, triplet and contrastive (issue 7).

  python -m experiments.auprc_retrieval --workdir=/tmp/auprc_retrieval
  python -m experiments.auprc_retrieval --workdir=/tmp/auprc_tiny \
      --config=experiments/configs/auprc_retrieval.py:runlocal

One run config per (task, method, seed) of the grid below: `common.base_config()` with
task="retrieval" (every run field is documented there, section `auprc`). The grid fields
(seeds, tasks, methods, results_dir) belong to the experiment and are not part of a run's
config. Argument: "[runlocal]": "" (the committed results, ~13 min on 2 CPU cores), "runlocal"
(seconds; used by tests/test_auprc_experiment.py).
"""
from experiments.configs import common

GRID_FIELDS = ("seeds", "tasks", "methods", "results_dir")


def get_config(arg: str = ""):
  args = common.parse_arg(arg, runlocal=False)
  c = common.base_config()
  c.task = "retrieval"
  c.seeds = (0, 1, 2)                 # One full run per seed; the table reports mean and std.
  c.tasks = ("bibtex", "synthetic")   # Retrieval tasks (dataset.name of each run).
  # Trained methods; "untrained" (the initial tower) is always evaluated too.
  c.methods = ("soprc", "soprc_sg", "soprc_sg_var", "ap_loss", "smooth_ap", "triplet",
               "contrastive")
  c.results_dir = ""                  # Also copy results.json/.md here (e.g. results/auprc); "" = workdir only.

  c.model.hidden = 256                # Width of the MLP's hidden layer.
  c.model.out = 64                    # Embedding width; scores are cosines in [-1, 1].
  c.optimizer.name = "adam"
  c.optimizer.learning_rate = 1e-3
  c.train.num_steps = 400             # Optimisation steps per run.
  c.train.batch_size = 224            # B, as in the paper (56 classes x 4).
  c.train.log_every = 10
  c.train.eval_every = 0              # Test metrics at the end only.
  c.train.checkpoint_every = 100
  c.eval.select_metric = "map"
  return common.finish(c, args, small=_runlocal)


def _runlocal(c):
  """Seconds-long runs (tests): one seed, the small synthetic task, SOPRC only."""
  c.seeds = (0,)
  c.tasks = ("synthetic",)
  c.methods = ("soprc",)
  c.auprc.synthetic.num_train_classes = 24
  c.auprc.synthetic.num_test_classes = 16
  c.auprc.synthetic.max_class_size = 40
  c.auprc.synthetic.nuisance_dim = 16
  c.model.hidden = 64
  c.model.out = 16
  c.train.num_steps = 60
  c.train.batch_size = 64
  c.train.checkpoint_every = 20
  c.optimizer.learning_rate = 1e-2
  c.auprc.soprc.num_aux = 8


def run_config(config, task: str, method: str, seed: int):
  """The config of one run of the grid: the experiment's fields without the grid ones."""
  c = config.copy_and_resolve_references()
  c.unlock()
  for name in GRID_FIELDS:
    del c[name]
  c.dataset.name, c.auprc.method, c.seed = task, method, seed
  if method == "untrained":
    c.train.num_steps, c.train.checkpoint_every = 1, -1  # the loop runs >= 1 step; the loss is 0
  c.lock()
  return c
