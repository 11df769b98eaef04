r"""SOPRC retrieval: SOPRC vs AP loss, Smooth-AP, triplet and contrastive (issue 7).

  python -m experiments.auprc_retrieval --workdir=/tmp/auprc_retrieval
  python -m experiments.auprc_retrieval --workdir=/tmp/auprc_tiny \
      --config=experiments/configs/auprc_retrieval.py:runlocal

Variants: "" (the committed results, ~8 min on 2 CPU cores), "runlocal" (seconds;
used by tests/test_auprc_experiment.py).
"""
import ml_collections


def get_config(arg: str = ""):
  c = ml_collections.ConfigDict()
  c.seeds = (0, 1, 2)                 # One full run per seed; the table reports mean and std.
  c.tasks = ("bibtex", "synthetic")   # Retrieval tasks, see `bibtex` and `synthetic` below.
  # Trained methods; "untrained" (the initial tower) is always evaluated too.
  # soprc = Eq. 8 with gradients through h(x+) in the denominator (paper);
  # soprc_sg = the same with that gradient stopped (the authors' code);
  # soprc_sg_var = soprc_sg + the semi-variance regulariser (Eq. 9).
  c.methods = ("soprc", "soprc_sg", "soprc_sg_var", "ap_loss", "smooth_ap", "triplet",
               "contrastive")
  c.results_dir = ""                  # Also copy results.json/.md here (e.g. results/auprc); "" = workdir only.

  c.bibtex = ml_collections.ConfigDict()
  c.bibtex.data_dir = ""              # Root holding bibtex/ ("" = snm_jax.data's search path).
  # Category of a point among its labels: rarest (most specific tag, every
  # category then has >= 4 training points) | first | most_frequent.
  c.bibtex.category_rule = "rarest"
  c.bibtex.tfidf = True               # TF-IDF weighting (IDF from train) before row L2 normalisation.

  c.synthetic = ml_collections.ConfigDict()
  c.synthetic.seed = 1234             # The task's own seed (fixed across run seeds).
  c.synthetic.num_train_classes = 100  # Training classes; test classes are new, disjoint ones.
  c.synthetic.num_test_classes = 100
  c.synthetic.max_class_size = 200    # Size of the largest class; class k has ~max * k^-exponent points.
  c.synthetic.zipf_exponent = 1.0     # Long tail of class sizes.
  c.synthetic.min_class_size = 6      # Floor on class sizes (>= samples_per_class).
  c.synthetic.signal_dim = 16         # Dimensions carrying the class centre.
  c.synthetic.nuisance_dim = 48       # Extra high-variance dimensions the tower must learn to ignore.
  c.synthetic.within_class_std = 0.8  # Spread of a class around its centre (centres are N(0, I)).
  c.synthetic.nuisance_std = 2.0      # Std of the nuisance dimensions.

  c.model = ml_collections.ConfigDict()
  c.model.hidden = 256                # Width of the MLP's hidden layer.
  c.model.embed_dim = 64              # Embedding width; scores are cosines in [-1, 1].

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 400             # Optimisation steps per run.
  c.train.batch_size = 224            # B, as in the paper (56 classes x 4).
  c.train.samples_per_class = 4       # Positives per class per batch.
  c.train.class_weighting = "size"    # Draw classes by size (every point equally often) | uniform.
  c.train.learning_rate = 1e-3        # optax.adam step size.

  c.soprc = ml_collections.ConfigDict()
  c.soprc.tau1 = 0.1                  # One-sided Huber margin (authors' default).
  c.soprc.tau2 = 0.001                # One-sided sigmoid temperature (authors' default).
  c.soprc.beta = 0.01                 # EMA rate of v (paper: 0.001 over far longer training).
  c.soprc.num_aux = 32                # Length of each class's v (a fixed quantile grid per class).
  c.soprc.init_from_first_batch = True  # A class's first interpolation replaces the uniform init.
  # Prior pi_k used in (1 - pi)/pi: 0 = the true prior (N_k - 1)/(N - 1);
  # > 0 = the authors' prior_mul: pi_k = prior_mul * N_k / max_k N_k.
  c.soprc.prior_mul = 0.0
  # Semi-variance weights of Eq. 9, used by soprc_sg_var only. The authors'
  # (5, 1) collapsed Bibtex to ~7% mAUPRC in a pilot run; (0.5, 0.1) is neutral.
  c.soprc.lambda_pos = 0.5            # lambda1, positives below their mean.
  c.soprc.lambda_neg = 0.1            # lambda2, negatives above their mean.

  c.ap_loss = ml_collections.ConfigDict()
  c.ap_loss.tau1 = 0.1                # Same surrogates as SOPRC.
  c.ap_loss.tau2 = 0.001

  c.smooth_ap = ml_collections.ConfigDict()
  c.smooth_ap.temperature = 0.01      # Sigmoid temperature of Smooth-AP.

  c.triplet = ml_collections.ConfigDict()
  c.triplet.margin = 0.1              # Cosine margin: s(a, n) + margin <= s(a, p).

  c.contrastive = ml_collections.ConfigDict()
  c.contrastive.margin = 0.5          # Cosine-distance margin (snm_jax.losses.cosine_contrastive_loss).

  c.eval = ml_collections.ConfigDict()
  c.eval.recall_ks = (1, 2, 4, 8)     # Recall@k: a same-category item among the k nearest.

  if arg == "runlocal":
    c.seeds = (0,)
    c.tasks = ("synthetic",)
    c.methods = ("soprc",)
    c.synthetic.num_train_classes = 24
    c.synthetic.num_test_classes = 16
    c.synthetic.max_class_size = 40
    c.synthetic.nuisance_dim = 16
    c.model.hidden = 64
    c.model.embed_dim = 16
    c.train.num_steps = 60
    c.train.batch_size = 64
    c.train.learning_rate = 1e-2
    c.soprc.num_aux = 8
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of auprc_retrieval.py; choose '' or 'runlocal'")
  c.lock()
  return c
