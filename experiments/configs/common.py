"""The full set of config fields, with their defaults and meaning, and what every config shares.

Every experiment config starts from `base_config()` and overrides fields; any
field can also be overridden on the command line (`--config.mining.k=16`).
A config's argument (`--config=file.py:arg`) is parsed by `parse_arg` into
typed values declared with their defaults; every config has `runlocal`, the
seconds-long variant for tests: `file.py:runlocal`, `file.py:bibtex,runlocal`.
Fields renamed since: snm_jax/train/config/overrides.py RENAMED_FIELDS (the old names
are refused with the new one).
"""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0                      # Drives init, sampling and data order; same seed -> same bits.

  c.dataset = ml_collections.ConfigDict()
  c.dataset.name = "bibtex"       # A dataset in ../shared/data or the cache, "synthetic", or "files" (below).
  c.dataset.data_dir = ""         # Overrides the search path for real datasets.
  # Multilabel -> multiclass conversion of the training set:
  # sample_one_positive (SNM paper) | expand_all_positives (S2M) | first_label (Bamler & Mandt) | smallest_label_drop_empty.
  c.dataset.conversion = "sample_one_positive"
  c.dataset.max_nnz = 0           # Padded nnz per row; 0 = the largest row of the training set. Truncation is counted.
  c.dataset.max_labels = 0        # Padded label-set width; 0 = the largest label set.
  c.dataset.normalize_rows = True  # Row L2 normalisation of the features.
  # Share of the training file held out as a validation split (model selection); 0 = none. The test
  # split is never touched; propensities and Head/Torso/Tail use the whole training file's label counts.
  c.dataset.validation_fraction = 0.0
  # Seed of the held-out rows' permutation (independent of `seed`: every run sees the same validation set).
  c.dataset.validation_seed = 0
  # Where the rows come from: memory (the files above, loaded whole) | sharded (ArrayRecord shards written by
  # `python -m experiments.convert`, read by index while training: host memory does not grow with the data).
  c.dataset.format = "memory"
  c.dataset.shards = ""           # dataset.format=sharded: the converted dataset's directory (local or gs://...).
  c.dataset.read_threads = 1      # Threads building batches ahead of the step (Grain ReadOptions); 0 = in the loop.
  c.dataset.prefetch = 2          # Batches those threads keep ready.
  c.dataset.workers = 0           # Grain worker processes decoding batches (mp_prefetch); 0 = none.
  c.dataset.synthetic = ml_collections.ConfigDict()
  c.dataset.synthetic.num_labels = 4096      # K of the generator.
  c.dataset.synthetic.num_train = 20000      # Training points drawn.
  c.dataset.synthetic.num_test = 2000        # Test points drawn.
  c.dataset.synthetic.dim = 64               # Feature dimension.
  c.dataset.synthetic.seed = 1234            # The problem's own seed (fixed across run seeds).
  # dataset.name = "files": the four files below (snm_jax/data/array_files.py). Features: .npy (N, d) dense |
  # .npz (a scipy.sparse matrix from scipy.sparse.save_npz, or a dense array) | XC sparse text (trn_X_Xf.txt's
  # format). Labels: .npz (scipy.sparse (N, K), each stored nonzero a positive) | XC label text (trn_X_Y.txt's).
  # Test d and K must equal the training ones; dataset.validation_fraction carves from the training files.
  c.dataset.files = ml_collections.ConfigDict()
  c.dataset.files.train_features = ""  # Path of the training features (N, d).
  c.dataset.files.train_labels = ""    # Path of the training labels (N, K).
  c.dataset.files.test_features = ""   # Path of the test features (same d).
  c.dataset.files.test_labels = ""     # Path of the test labels (same K).

  c.model = ml_collections.ConfigDict()
  # snm_tower (EmbeddingBag -> ReLU -> Dense -> L2; large d) | linear (Bamler & Mandt) |
  # wide_deep (q = [x, 1, tower(x)]: linear + tower). linear / wide_deep use a K x (d + 1 [+ out]) table: moderate d.
  # mlp (dense inputs, e.g. image / text embeddings: x (N, d) -> [Dense(hidden) -> ReLU -> dropout] x
  # num_hidden_layers -> Dense(out) -> L2; batches of dense rows, sparse data is densified).
  c.model.kind = "snm_tower"
  c.model.hidden = 512            # Embedding-bag width (mlp: width of each hidden layer).
  c.model.num_hidden_layers = 1   # model.kind=mlp only: hidden layers (0 = a linear map, then L2).
  c.model.out = 512               # Query / class embedding width h.
  # Score with L2-normalised class rows (cosines in [-1, 1]). Unset = auto: True for snm_tower, False for
  # linear / wide_deep (True is an error there). A typed placeholder: --config.model.normalize_classes=False parses.
  c.model.normalize_classes = ml_collections.config_dict.placeholder(bool)
  c.model.dropout = 0.0           # Dropout rate on the tower's bag output (mlp: after each hidden ReLU); training only, [0, 1); the masks from 16-bit draws (8-bit when 1 - rate is a multiple of 1/256), their keep rate within 2^-17 (models/dropout.py).
  c.model.feature_dropout = 0.0   # Rate of dropping input nonzeros (mlp: input entries) in training (kept ones scaled by 1/(1-rate)), [0, 1).
  # Tower input layer: gather (cost independent of d; for large d) | dense (densified input x table: faster for d <~ 10^4).
  c.model.bag_matmul = "gather"
  # How the tower's gathered input table (its EmbeddingBag, d x hidden, with bag_matmul=gather; snm_tower
  # and wide_deep) is trained: sparse (held like the class table, sharded over `model`: only the rows of
  # the batch's feature ids get gradients and updates, with the tower optimiser's row-wise counterpart:
  # sgd -> sgd, momentum -> lazy momentum, adagrad -> row-wise adagrad, adam refused; step cost
  # independent of d) | dense (a flax parameter: a dense d x hidden gradient, optax updates all d rows
  # each step; how every run before this field trained). bag_matmul=dense is a dense layer: dense update.
  c.model.input_update = "sparse"
  # Compute dtype of the towers and the scores: float32 | bfloat16 (parameters stay float32; matmuls take
  # bfloat16 factors and accumulate in float32; queries, norms and every loss are float32). See docs/design.md.
  c.model.dtype = "float32"

  c.table = ml_collections.ConfigDict()
  c.table.optimizer = "sgd"       # Row-wise sparse optimiser: sgd | momentum | adagrad.
  c.table.learning_rate = 1.0     # Peak learning rate of the row-wise optimiser (table.warmup_steps, table.decay).
  c.table.momentum = 0.9          # For table.optimizer=momentum.
  c.table.init_scale = 1.0        # Std of the N(0, s^2) initial rows (before normalisation at use).
  c.table.warmup_steps = 0        # Linear warm-up of the table's learning rate from 0 over this many steps.
  c.table.decay = "constant"      # constant | cosine (to 0 at train.num_steps).
  # Decoupled L2 decay: each row a step touches is multiplied by 1 - lr_t * wd, once (lazy: untouched rows are not decayed).
  c.table.weight_decay = 0.0
  # Storage dtype of the class table: float32 | bfloat16 (half the memory). Gathered rows are upcast to float32,
  # the row update computed in float32 (optimiser state float32) and rounded back when written.
  c.table.dtype = "float32"
  # How a bfloat16 table's updated rows are rounded: stochastic (unbiased; bits from the step's key and the row
  # id: deterministic given the seed) | nearest (even): loses every update below half an ulp of the entry
  # (chosen on Bibtex's 10% validation split, experiments/sweeps/bf16_rounding.py, 3 seeds: validation
  # P@1 / R@5 float32 0.558 / 0.557, stochastic 0.560 / 0.556, nearest 0.551 / 0.548; results/bf16_rounding).
  c.table.rounding = "stochastic"

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "momentum"   # optax optimiser of the dense tower: sgd | momentum | adam | adagrad.
  c.optimizer.learning_rate = 0.1  # Peak learning rate of the tower (and of its sparse input table).
  c.optimizer.momentum = 0.9      # For optimizer.name=momentum (also the sparse input table's lazy momentum).
  c.optimizer.warmup_steps = 0    # Linear warm-up of the tower's learning rate from 0 over this many steps.
  c.optimizer.decay = "constant"  # constant | cosine (to 0 at train.num_steps).
  c.optimizer.weight_decay = 0.0  # Decoupled weight decay of the tower's kernels and embeddings (not biases); adam -> adamw.

  c.loss = ml_collections.ConfigDict()
  # bowl | powl (SNM) | sampled_softmax | mined_softmax (sampled softmax's value, gradient to the
  # mining.k largest corrected logits only) | full_softmax | logistic_ns | adversarial_ns | nce.
  c.loss.kind = "bowl"
  c.loss.phi = "hinge"            # hinge | squared_hinge | logistic | exponential | ramp.
  c.loss.ramp_rho = 1.0           # rho of the ramp surrogate.
  c.loss.logit_scale = 1.0        # Scores are multiplied by this before the loss (inverse softmax temperature).
  c.loss.reduction = "mean"       # mean | s2m (average of the k' largest per-example losses).
  c.loss.k_prime = 0              # k' of S2M; must be <= train.batch_size.
  c.loss.adv_lambda = 1e-3        # lambda of Bamler & Mandt's Eq. 6 regulariser (loss.kind=adversarial_ns).
  # Drop sampled negatives equal to a positive? None (a typed placeholder): the loss's convention (registry.py):
  # False for logistic_ns / adversarial_ns / nce (Eq. 2 / Eq. 6 / NCE draw y' ~ p_n with no exclusion;
  # True is allowed), True (required) for bowl / powl / sampled_softmax / mined_softmax / full_softmax.
  c.loss.mask_accidental_hits = ml_collections.config_dict.placeholder(bool)

  c.mining = ml_collections.ConfigDict()
  # uniform | unigram (stratified, with replacement, positives drawn then masked: approximations of
  # Reddi et al.'s Algorithm 1) | exact (Algorithm 1: B distinct labels per example, uniform over
  # [K] minus its positives; needs B < K) | full (all labels; small K only) | tree (Bamler & Mandt).
  c.mining.sampler = "uniform"
  # uniform / unigram only. False: B ids shared by the minibatch; True: B per example (still with
  # replacement: an approximation of Algorithm 1, see mining.sampler="exact").
  c.mining.per_example = False
  c.mining.num_samples = 1024     # B.
  # B growing during training (Reddi et al. 2019 leave it open, Sec. 7): ((start_step, B), ...) sorted, the
  # first at 0, e.g. ((0, 1024), (4000, 2048), (8000, 4096)): the states at state.step >= start_step (logged
  # steps start_step + 1, ...) draw B negatives and use the loss B defines (vartheta, logQ counts). () = B is
  # mining.num_samples throughout; with a schedule mining.num_samples is unused. One step compiled per B
  # (snm_jax/train/config/sample_schedule.py). Samplers uniform, unigram, exact, tree. Command line:
  # --config.mining.num_samples_schedule="((0,1024),(4000,2048))". Not changeable on resume.
  c.mining.num_samples_schedule = ()
  c.mining.num_strata = 8         # V: sampling strata; the mesh's model size must divide it.
  c.mining.unigram_power = 1.0    # p(y) ~ count^power for the unigram sampler.
  c.mining.k = 16                 # Hardest negatives kept (vartheta's support; mined_softmax: those with gradient).
  c.mining.vartheta = "top_k"     # top_k | negative_sampling | power_law.
  # Normalisation of vartheta: mean (top_k: 1/k, the average of the k hardest; negative_sampling: 1/B,
  # the average over all B) | expectation ((K-1)/(kB): E[loss] is an OWL, Lemma 2).
  c.mining.vartheta_norm = "mean"
  c.mining.power_alpha = 1.0      # power_law exponent.
  c.mining.floor = 0.0            # Calibration floor eps for j > k (footnote 2 of Reddi et al.).

  c.adversarial = ml_collections.ConfigDict()
  c.adversarial.pca_dim = 16          # The tree works on PCA-k features (k = 16 in the paper).
  c.adversarial.node_reg = 0.1        # lambda_n of each node's Newton fit.
  c.adversarial.max_reassign_iters = 1000  # Safety cap: each level re-assigns until no label moves.
  c.adversarial.debias_eval = True    # Predict with xi + log p_n(y|x) (Eq. 5).
  # Fit the tree on a uniform, seeded sample of at most this many training points (their (point,
  # label) pairs); 0 = every point (in memory only: with dataset.format=sharded it must be > 0).
  c.adversarial.fit_max_points = 0

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1)          # (data, model); one entry may be -1.

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 256        # Global minibatch N.
  c.train.num_steps = 1000        # Training steps (minibatches) in all.
  c.train.log_every = 50          # Steps between logged training metrics (also logged at the last step).
  c.train.eval_every = 500        # 0 = only at the end.
  c.train.checkpoint_every = 500  # 0 = only at the end; -1 = never.
  c.train.keep_checkpoints = 2    # Newest checkpoints kept in the workdir.
  c.train.fingerprint = True      # Write a sha256 of the final state to results.json (reproducibility checks).
  c.train.on_nonfinite = "stop"   # stop | skip (the batch's update is dropped and counted).
  c.train.max_skipped_steps = 10  # on_nonfinite=skip stops like stop once more steps than this were skipped.
  # When no checkpoint of the workdir is readable: restart (move them aside, say so, train from step 0) | fail.
  c.train.on_unreadable_checkpoints = "restart"
  # Signals that mean "preempted": the run finishes its step, checkpoints (state and input position) and
  # exits with status 75; the same command resumes it. Several processes agree on the step through JAX's
  # preemption service. Comma-separated names, e.g. "SIGTERM,SIGUSR1"; "" = none (the signal's default).
  c.train.preemption_signals = "SIGTERM"
  # With a validation split: stop after this many evaluations without a better eval.select_metric (0 = never).
  c.train.patience = 0

  c.eval = ml_collections.ConfigDict()
  c.eval.k_max = 5                # P@k / nDCG@k / PSP@k for k = 1..k_max (k=1,3,5 reported).
  c.eval.recall_r = 100           # Largest r of retrieval recall@r curves.
  c.eval.query_chunk = 512        # Queries per retrieval call (bounded memory).
  c.eval.row_block = 4096         # Class rows scored per scan block.
  c.eval.max_examples = 0         # Evaluate on the first n test points (0 = all).
  c.eval.log_likelihood = False   # Also the predictive log-likelihood of each point's first label (O(K) per query).
  # Jain et al. propensity A and B; None: the dataset's published values (metrics.propensity_params:
  # Amazon 0.6/2.6, Wikipedia 0.5/0.4, else 0.55/1.5). Set, they are used for every dataset.
  c.eval.psp_a = ml_collections.config_dict.placeholder(float)
  c.eval.psp_b = ml_collections.config_dict.placeholder(float)  # B, as psp_a: None = the published value.
  # Validation metric that selects the state evaluated on test (needs dataset.validation_fraction > 0).
  c.eval.select_metric = "P@1"

  # Sampler diagnostics on a fixed probe batch (snm_jax/train/core/diagnostics.py), logged as diag/...:
  # mining recall@k against exact mining over all K, the rank of the hardest sampled negative,
  # and the class-table gradient's signal-to-noise ratio over independent negative draws.
  c.diagnostics = ml_collections.ConfigDict()
  c.diagnostics.every = 0          # Steps between diagnostics (0 = off).
  c.diagnostics.probe_size = 64    # The first n training points (divisible by the data axis).
  c.diagnostics.k = 0              # Mined set / exact hardest set size (0 = mining.k).
  c.diagnostics.snr_draws = 16     # R negative draws for the gradient SNR (0 = no SNR; else >= 2).

  # A recipe derives the fields left at "auto" / -1 from the data and chooses among candidates on
  # the validation split (snm_jax/train/recipes/recipe.py; experiments/configs/xmc.py). "" = a plain run.
  c.recipe = ml_collections.ConfigDict()
  c.recipe.name = ""              # Set (e.g. "xmc", recorded in results.json): the run is a recipe.
  c.recipe.search = ""            # Candidate grid, e.g. "table.learning_rate*=0.5,1,2;dataset.conversion=a,b".
  c.recipe.epochs = 80.0          # train.num_steps=-1: this many passes over the training part...
  c.recipe.min_steps = 500        # ...clipped to [min_steps, max_steps].
  c.recipe.max_steps = 4000       # Largest derived train.num_steps (recipe.epochs' clip).
  c.recipe.evaluations = 20       # Validation evaluations per run (train.eval_every=-1).
  c.recipe.refit = False          # Retrain the chosen candidate on the whole training file for its selected steps.
  # Ensembles of the top-m candidates by validation, m = 1..ensemble, scored by the sum of their logits;
  # m chosen on validation (snm_jax/train/recipes/ensemble.py). 1 = the best candidate alone, 0 = up to all.
  c.recipe.ensemble = 1
  # Validation splits the candidates are trained and chosen on (seeds dataset.validation_seed + i):
  # the choice reads the mean over the splits and the result sums every split's models. -1 (auto):
  # ceil(min_validation / M), at most recipes.MAX_SPLITS, while the validation split holds M <
  # min_validation points, else 1.
  c.recipe.splits = 1
  c.recipe.min_validation = 1000  # recipe.splits=-1: fewer validation points than this -> several splits.
  # With several splits: all (every candidate trained, halved and chosen on every split) | first (on
  # split 0 only; the chosen members are then trained on the other splits and summed as with "all").
  c.recipe.split_search = "all"
  # Post-hoc logit adjustment of the chosen model / ensemble (Menon et al. 2021): score - tau log prior(y),
  # tau from this comma-separated grid (0 always in it) chosen on validation (snm_jax/train/core/logit_adjust.py).
  # "" = off.
  c.recipe.logit_adjust = ""
  # Train the candidates of one shape (equal but for table.learning_rate, seed and the validation
  # split) together, as one vmapped program (snm_jax/train/trainer/group.py). False: one run each.
  c.recipe.group = True
  # How a group trains: vmap (the members' states stacked, one vmapped step) | serial (one compiled
  # step called per member) | auto (serial on CPU, where it measured faster; vmap on GPU / TPU).
  c.recipe.group_mode = "auto"
  # Train steps per dispatch in serial mode: the step scanned over that many batches (gathered on the
  # devices in one call) between two evaluations or checkpoints; the rest one by one. 1 = one each.
  c.recipe.steps_per_call = 8
  # Devices the members of serial groups are dealt over, each on a one-device mesh, the groups side by
  # side (snm_jax/train/runtime/member_devices.py). -1 (auto): on the CPU backend in one process, one
  # per core (experiments.train gives the process one CPU device per core), with mesh.shape (-1, 1)
  # or (1, 1); 0: every member on the config's mesh; n: the first n devices (serial groups only).
  c.recipe.member_devices = -1
  # Successive halving (Jamieson & Talwalkar 2016): at the rungs train.num_steps / halving^j
  # (j = rungs..1) only the best ceil(n / halving) candidates by validation so far (at least
  # recipe.ensemble) train on; the others stop and are never evaluated on test. 0 = off.
  c.recipe.halving = 3
  c.recipe.rungs = 2              # Rungs of the successive halving (recipe.halving > 1).
  # At each rung, also stop the candidates clearly behind the leader, even below recipe.ensemble:
  # the mean over the validation points of the paired difference in eval.select_metric (a P@k, R@k
  # or nDCG@k) above this many standard errors (snm_jax/train/recipes/candidates.py). 0 = off.
  c.recipe.drop_behind_z = 0.0

  c.distributed = ml_collections.ConfigDict()
  c.distributed.initialize = "auto"  # auto (if the environment names a coordinator) | yes | no.
  c.distributed.coordinator_address = ""  # host:port of process 0; "" = from the environment.
  c.distributed.num_processes = 0  # Processes in the job; 0 = from the environment.
  c.distributed.process_id = -1   # This process's index; -1 = from the environment.

  # ---- the task trained (snm_jax/train/core/task.py) -------------------------------------------------
  # classification (the sections above) | retrieval (SOPRC and the other AUPRC losses on
  # class-balanced embedding batches, snm_jax/train/trainer/retrieval.py; experiments/configs/auprc_retrieval.py).
  # task=retrieval reads: seed, dataset.name (bibtex | synthetic) and dataset.data_dir, model.hidden
  # and model.out (the MLP tower's widths), optimizer.*, train.*, eval.select_metric, mesh, and
  # the auprc section; dataset.validation_fraction must be 0.
  c.task = "classification"
  c.auprc = ml_collections.ConfigDict()
  # soprc | soprc_sg | soprc_sg_var | ap_loss | smooth_ap | triplet | contrastive | untrained
  # (loss 0: the initial tower); see snm_jax/auprc/losses.py.
  c.auprc.method = "soprc"
  c.auprc.samples_per_class = 4       # M: items per class in a batch of train.batch_size = G x M.
  c.auprc.class_weighting = "size"    # Draw classes by size (every point equally often) | uniform.
  c.auprc.recall_ks = (1, 2, 4, 8)    # Recall@k: a same-category item among the k nearest.
  # Bibtex: category of a point among its labels: rarest (most specific tag) | first | most_frequent.
  c.auprc.category_rule = "rarest"
  c.auprc.tfidf = True                # Bibtex: TF-IDF weighting (IDF from train) before row L2 normalisation.
  c.auprc.synthetic = ml_collections.ConfigDict()  # dataset.name=synthetic (snm_jax/data/retrieval_tasks.py)
  c.auprc.synthetic.seed = 1234             # The task's own seed (fixed across run seeds).
  c.auprc.synthetic.num_train_classes = 100  # Training classes; test classes are new, disjoint ones.
  c.auprc.synthetic.num_test_classes = 100   # Test classes (the queries and the gallery).
  c.auprc.synthetic.max_class_size = 200    # Size of the largest class; class k has ~max * k^-exponent points.
  c.auprc.synthetic.zipf_exponent = 1.0     # Long tail of class sizes.
  c.auprc.synthetic.min_class_size = 6      # Floor on class sizes (>= samples_per_class).
  c.auprc.synthetic.signal_dim = 16         # Dimensions carrying the class centre.
  c.auprc.synthetic.nuisance_dim = 48       # Extra high-variance dimensions the tower must learn to ignore.
  c.auprc.synthetic.within_class_std = 0.8  # Spread of a class around its centre (centres are N(0, I)).
  c.auprc.synthetic.nuisance_std = 2.0      # Std of the nuisance dimensions.
  c.auprc.soprc = ml_collections.ConfigDict()
  c.auprc.soprc.tau1 = 0.1            # One-sided Huber margin (authors' default).
  c.auprc.soprc.tau2 = 0.001          # One-sided sigmoid temperature (authors' default).
  c.auprc.soprc.beta = 0.01           # EMA rate of v (paper: 0.001 over far longer training).
  c.auprc.soprc.num_aux = 32          # Length of each class's v (a fixed quantile grid per class).
  c.auprc.soprc.init_from_first_batch = True  # A class's first interpolation replaces the uniform init.
  # before_gradient: v_{t+1} from the batch, then the gradient with v_{t+1} (Algorithm 1 of the paper) |
  # after_gradient: the gradient with v_t, then v_{t+1} (the order of the first experiment, issue 7).
  c.auprc.soprc.aux_update = "before_gradient"
  # Prior pi_k in (1 - pi)/pi: 0 = the true prior (N_k - 1)/(N - 1); > 0 = the authors'
  # prior_mul: pi_k = prior_mul * N_k / max_k N_k.
  c.auprc.soprc.prior_mul = 0.0
  # Semi-variance weights of Eq. 9 (soprc_sg_var only). The authors' (5, 1) collapsed Bibtex to
  # ~7% mAUPRC in a pilot run; (0.5, 0.1) is neutral.
  c.auprc.soprc.lambda_pos = 0.5      # lambda1, positives below their mean.
  c.auprc.soprc.lambda_neg = 0.1      # lambda2, negatives above their mean.
  c.auprc.ap_loss = ml_collections.ConfigDict()
  c.auprc.ap_loss.tau1 = 0.1          # Same surrogates as SOPRC.
  c.auprc.ap_loss.tau2 = 0.001        # One-sided sigmoid temperature, as auprc.soprc.tau2.
  c.auprc.smooth_ap = ml_collections.ConfigDict()
  c.auprc.smooth_ap.temperature = 0.01  # Sigmoid temperature of Smooth-AP.
  c.auprc.triplet = ml_collections.ConfigDict()
  c.auprc.triplet.margin = 0.1        # Cosine margin: s(a, n) + margin <= s(a, p).
  c.auprc.contrastive = ml_collections.ConfigDict()
  c.auprc.contrastive.margin = 0.5    # Cosine-distance margin (snm_jax.losses.cosine_contrastive_loss).
  return c


# Public statistics of the Extreme Classification Repository datasets used by the
# papers: labels K, features d, training points.
PAPER_DATASETS = {
    "amazoncat-13k": dict(num_labels=13_330, num_features=203_882, num_train=1_186_239),
    "wiki-lshtc-325k": dict(num_labels=325_056, num_features=1_617_899, num_train=1_778_351),
    "amazon-670k": dict(num_labels=670_091, num_features=135_909, num_train=490_449),
    "amazon-3m": dict(num_labels=2_812_281, num_features=337_067, num_train=1_717_899),
}


def apply_paper_scale(c, dataset: str):
  """The papers' settings for one of PAPER_DATASETS (Reddi et al. 2019 Sec. 6; Rawat et al. 2021).

  512-wide embeddings, B = 1,024 sampled negatives for AmazonCat-13K and
  32,768 for the others, SGD with a large learning rate for the tables and
  SGD with momentum for the dense layer; ~10 epochs at batch size 1,024.
  These datasets are not bundled: the config runs where they are in the data
  path (or downloaded by the user), and is smoke-tested here on synthetic data
  of the same K and width.
  """
  stats = PAPER_DATASETS[dataset]
  c.dataset.name = dataset
  c.dataset.conversion = "sample_one_positive"
  c.model.hidden = 512
  c.model.out = 512
  c.mining.num_samples = 1024 if dataset == "amazoncat-13k" else 32_768
  c.mining.num_strata = 8
  c.table.optimizer = "sgd"
  c.table.learning_rate = 10.0
  c.optimizer.name = "momentum"
  c.optimizer.learning_rate = 0.1
  c.train.batch_size = 1024
  c.train.num_steps = 10 * stats["num_train"] // c.train.batch_size
  c.train.log_every = 500
  c.train.eval_every = 20_000
  c.train.checkpoint_every = 5_000
  c.eval.query_chunk = 1024
  c.eval.row_block = 16_384
  c.dataset.synthetic.num_labels = stats["num_labels"]
  return c


# Short names of PAPER_DATASETS as config arguments (`snm.py:amazon670k`).
PAPER_VARIANTS = {
    "amazoncat13k": "amazoncat-13k",
    "wikilshtc325k": "wiki-lshtc-325k",
    "amazon670k": "amazon-670k",
    "amazon3m": "amazon-3m",
}
SMALL_DATASETS = ("bibtex", "delicious", "synthetic")


def configure_dataset(c, variant: str):
  """Dataset-dependent settings shared by the SNM / NS / S2M / softmax configs (and default.py):
  the papers' settings for a PAPER_VARIANTS name, else a few-minute run on a SMALL_DATASETS one."""
  if variant in PAPER_VARIANTS:
    return apply_paper_scale(c, PAPER_VARIANTS[variant])
  if variant not in SMALL_DATASETS:
    raise ValueError(f"unknown dataset variant {variant!r}; choose from {', '.join(SMALL_DATASETS)}, "
                     f"{', '.join(PAPER_VARIANTS)}")
  c.dataset.name = variant
  c.model.hidden = 256
  c.model.out = 256
  c.mining.num_samples = 64 if variant == "bibtex" else 256
  c.table.learning_rate = 0.5
  c.optimizer.learning_rate = 0.05
  # Hinge margins of 1 on raw cosines in [-1, 1] are always active, which makes BOWL == POWL and top-1
  # mining a linear push on one negative; scaled scores make the margin meaningful (measured on Bibtex,
  # 1000 steps: top-1 P@1 0.377 -> 0.476, top-16 0.433 -> 0.552, negative sampling 0.449 -> 0.451).
  c.loss.logit_scale = 8.0
  c.train.batch_size = 128
  c.train.num_steps = 1000 if variant == "bibtex" else 2000
  c.train.log_every = 100
  c.train.eval_every = 250
  c.train.checkpoint_every = 500
  return c


def shorten_run(c, num_steps: int, log_every: int, batch_size: int = 32):
  """The run-length part of a runlocal variant: `num_steps` steps of `batch_size` (k' clipped to
  it), logging every `log_every`, evaluating and checkpointing halfway and at the end."""
  c.train.num_steps = num_steps
  c.train.batch_size = batch_size
  c.loss.k_prime = min(c.loss.k_prime, batch_size)
  c.train.log_every = log_every
  c.train.eval_every = num_steps // 2
  c.train.checkpoint_every = num_steps // 2
  return c


def apply_runlocal(c):
  """Shrinks everything for a seconds-long local run (tests, debugging)."""
  c.model.hidden = 32
  c.model.out = 32
  c.mining.num_samples = min(c.mining.num_samples, 64)
  c.mining.k = min(c.mining.k, c.mining.num_samples)
  shorten_run(c, num_steps=20, log_every=5)
  c.eval.max_examples = 256
  return c


_TRUE, _FALSE = ("1", "true", "True", "yes"), ("0", "false", "False", "no")


def _convert(key: str, text: str, default):
  """`text` as the type of `default` (bool from 1/0/true/false/True/False/yes/no)."""
  if isinstance(default, bool):
    if text in _TRUE or text in _FALSE:
      return text in _TRUE
    raise ValueError(f"config argument {key}={text!r}: expected a bool ({'/'.join(_TRUE + _FALSE)})")
  try:
    return type(default)(text)
  except ValueError:
    raise ValueError(f"config argument {key}={text!r}: expected {type(default).__name__}") from None


def parse_arg(arg: str, **defaults) -> ml_collections.ConfigDict:
  """The `get_config(arg)` string as typed values (as big_vision's `bv_utils.parse_arg`).

  `defaults` declares every argument and its default; a given value is converted to the
  default's type (bool, int, float, str). `arg` is "key=value,..." where
    * a bare bool key means True: "runlocal" == "runlocal=1" == "runlocal=true";
    * a bare word first is the value of the first argument (the dataset / variant name):
      parse_arg("delicious,k=64,runlocal", variant="bibtex", k=16, runlocal=False)
      -> variant="delicious", k=64, runlocal=True.
  Unknown keys raise ValueError naming them and the allowed ones. Returns a locked ConfigDict
  (`args.k`), so a typo in the config file's own use of it fails too.
  """
  args = ml_collections.ConfigDict(defaults)
  names = list(defaults)
  unknown = []
  for i, item in enumerate(p.strip() for p in (arg or "").split(",")):
    if not item:
      continue
    key, eq, text = item.partition("=")
    if not eq:
      if isinstance(defaults.get(key), bool):
        text = "1"
      elif i == 0 and names and not isinstance(defaults[names[0]], bool):
        key, text = names[0], item
      else:
        raise ValueError(f"config argument {item!r}: expected key=value (or a bool key alone); "
                         f"allowed keys: {', '.join(names)}")
    if key not in defaults:
      unknown.append(key)
      continue
    args[key] = _convert(key, text, defaults[key])
  if unknown:
    raise ValueError(f"unknown config arguments {sorted(unknown)} in {arg!r}; allowed: {', '.join(names)}")
  args.lock()
  return args


def one_of(name: str, value: str, allowed) -> str:
  """`value` of the config argument `name` if it is in `allowed`, else ValueError."""
  if value not in allowed:
    raise ValueError(f"config argument {name}={value!r} is not one of {tuple(allowed)}")
  return value


def derive_from_data(c):
  """The fields a recipe fills from the training data's statistics (recipes.derive), left at their
  "auto" / -1 placeholders, and the cadences and schedule of its runs (xmc.py, default.py)."""
  c.model.bag_matmul = "auto"
  c.optimizer.learning_rate = 0.05
  c.loss.kind = "auto"
  c.mining.sampler = "auto"
  c.mining.num_samples = -1
  c.train.batch_size = -1
  c.train.num_steps = -1
  c.train.eval_every = -1
  c.train.checkpoint_every = 500
  c.train.log_every = 100
  c.table.learning_rate = -1.0
  c.table.decay = "cosine"
  return c


def finish(c, args, small=apply_runlocal):
  """Common tail of every config: with `runlocal` the small variant (`small(c)`), then lock."""
  if args.runlocal:
    small(c)
  c.lock()
  return c
