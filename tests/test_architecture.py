"""The architecture's rules, checked on the source: no import cycle, imports only
run down the layers, experiments/ holds no trainer, and the step and the loop
stay small (docs/ARCHITECTURE.md)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lower layers never import higher ones (README "Layout"). Within one layer
# imports are free as long as they form no cycle.
LAYERS = (
    ("snm_jax.errors", "snm_jax.sharding", "snm_jax.losses", "snm_jax.metrics", "snm_jax.models",
     "snm_jax.pca", "snm_jax.adversarial"),
    ("snm_jax.data", "snm_jax.auprc"),
    ("snm_jax.mining",),
    # snm_jax/train/ is five layers of its own (snm_jax/train/__init__.py).
    ("snm_jax.train.runtime",),
    ("snm_jax.train.core",),
    ("snm_jax.train.config",),
    ("snm_jax.train.trainer",),
    ("snm_jax.train.recipes",),
    ("experiments", "benchmarks"),
)


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT).with_suffix("")
  parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for top in ("snm_jax", "experiments"):
    for path in (ROOT / top).rglob("*.py"):
      out[_module_name(path)] = path
  return out


def _imports(path: pathlib.Path, name: str, known: set) -> set:
  """Project modules `path` imports, at module level or inside functions."""
  tree = ast.parse(path.read_text())
  package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        pkg = package.split(".")
        base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
      targets = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
      continue
    for t in targets:
      while t and t not in known:
        t = t.rpartition(".")[0]
      if t and t != name:
        found.add(t)
  return found


def _graph():
  mods = _modules()
  return {name: _imports(path, name, set(mods)) for name, path in mods.items()}


def _layer(module: str) -> int:
  for i, prefixes in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return i
  return -1


def test_import_graph_has_no_cycle():
  graph = _graph()
  # Packages import their submodules (re-exports); a submodule importing its own
  # package's __init__ is the only allowed back edge, so drop package -> child edges.
  edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in sorted(edges.get(m, ())):
      if state.get(d) == "open":
        raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
      if d not in state:
        visit(d)
    stack.pop()
    state[m] = "done"

  for m in sorted(edges):
    if m not in state:
      visit(m)


def test_imports_run_down_the_layers():
  upward = [(m, d) for m, deps in _graph().items() for d in deps
            if _layer(m) >= 0 and _layer(d) > _layer(m)]
  assert not upward, f"imports from a lower layer into a higher one: {upward}"


@pytest.mark.parametrize("pattern", ["value_and_grad", "jax.grad(", "lax.scan", "apply_updates",
                                     "tx.update("])
def test_experiments_hold_no_trainer(pattern):
  hits = [str(p.relative_to(ROOT)) for p in (ROOT / "experiments").rglob("*.py")
          if pattern in p.read_text()]
  assert not hits, f"{pattern!r} in {hits}: training code belongs in snm_jax/train"


@pytest.mark.parametrize("path,function,max_lines", [
    ("snm_jax/train/core/step.py", "make_train_step", 120),
    ("snm_jax/train/trainer/loop.py", "train_and_evaluate", 120),
])
def test_step_and_loop_stay_small(path, function, max_lines):
  tree = ast.parse((ROOT / path).read_text())
  fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
  assert fn.end_lineno - fn.lineno + 1 <= max_lines


def test_train_is_split_by_job():
  """snm_jax/train/ holds its five layer packages and nothing else (snm_jax/train/__init__.py)."""
  train = ROOT / "snm_jax" / "train"
  flat = sorted(p.name for p in train.glob("*.py") if p.name != "__init__.py")
  assert not flat, f"modules directly in snm_jax/train/: {flat}; put each in its layer's package"
  packages = {p.name for p in train.iterdir() if (p / "__init__.py").exists()}
  assert packages == {prefix.rsplit(".", 1)[1] for layer in LAYERS for prefix in layer
                      if prefix.startswith("snm_jax.train.")}
