"""Dotted config overrides ({"mining.k": 16}) on a ConfigDict, and the fields that were renamed.

One implementation for every place that sets fields by name: the sweeps
(`experiments.sweeps.spec.apply_overrides`), the recipes' candidates
(`snm_jax.train.recipes.recipe`), and the errors of `experiments.train` for an
unknown `--config.<field>`. A field that does not exist is a ConfigError that
names the closest valid ones, or the new name of a renamed field. Also the
recipes' placeholder ("auto" / -1) and their `recipe.search` grid of overrides
(`parse_search`), which `validation.validate` checks without importing the recipes.
"""

from __future__ import annotations

import copy
import difflib
import json
from typing import Any, Mapping

from snm_jax.errors import ConfigError

# Old config field -> its new name. The old names are refused wherever a field is named (command
# line, sweep and recipe overrides, config files, `validation.validate`), with the new name in the message.
RENAMED_FIELDS = {
    "mining.scale": "mining.vartheta_norm",  # the normalisation of vartheta: mean | expectation
    "loss.scale": "loss.logit_scale",        # the factor on the scores before the loss
}


# The placeholder a recipe config leaves in a field it derives from the data (strings; numbers use -1).
AUTO = "auto"


def is_auto(value) -> bool:
  """The recipe's "auto" / -1 placeholder (snm_jax/train/recipes/recipe.py resolves it)."""
  return value == AUTO or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == -1)


def renamed_error(field: str) -> ConfigError:
  """`config.mining.scale: renamed to mining.vartheta_norm` for a RENAMED_FIELDS key."""
  return ConfigError(field, f"renamed to {RENAMED_FIELDS[field]} (the old name is not accepted)")


def config_fields(config, prefix: str = "") -> list[str]:
  """Every leaf field of a ConfigDict as a dotted name ("mining.k", "dataset.synthetic.dim")."""
  out = []
  for key in config.keys():
    value = config[key]
    if hasattr(value, "keys"):
      out += config_fields(value, f"{prefix}{key}.")
    else:
      out.append(f"{prefix}{key}")
  return out


def unknown_field_error(config, field: str) -> ConfigError:
  """The ConfigError for an override of a field `config` does not have: the new name of a renamed
  field (`config.loss.scale: renamed to loss.logit_scale ...`), else the closest valid names
  (difflib), e.g. `config.mining.kk: no such config field; closest: mining.k`."""
  if field in RENAMED_FIELDS:
    return renamed_error(field)
  names = config_fields(config)
  close = difflib.get_close_matches(field, names, n=3, cutoff=0.6)
  if "." in field:  # also the leaf alone among its section's fields
    section, leaf = field.rsplit(".", 1)
    leaves = [n[len(section) + 1:] for n in names if n.startswith(section + ".")]
    close += [f"{section}.{n}" for n in difflib.get_close_matches(leaf, leaves, n=3, cutoff=0.5)
              if f"{section}.{n}" not in close]
  hint = (f"closest: {', '.join(close[:3])}" if close else
          f"the sections are {', '.join(k for k in config.keys() if hasattr(config[k], 'keys'))}")
  return ConfigError(field, f"no such config field; {hint} (every field: experiments/configs/common.py)")


def check_renamed(config) -> None:
  """Raises the renamed_error of the first RENAMED_FIELDS old name `config` holds (e.g. a config
  file of one's own that still sets `c.loss.scale` before locking)."""
  for old in RENAMED_FIELDS:
    section, leaf = old.split(".")
    if section in config and hasattr(config[section], "keys") and leaf in config[section]:
      raise renamed_error(old)


def apply_overrides(config, overrides: Mapping[str, Any]):
  """Sets dotted fields of `config` in place (a locked config stays locked: no field is added) and
  returns it. An unknown or renamed field raises `unknown_field_error`, a value of the wrong type
  ConfigError."""
  for key, value in overrides.items():
    *path, leaf = key.split(".")
    node = config
    try:
      for p in path:
        node = node[p]
      if leaf not in node:
        raise KeyError(leaf)
      node[leaf] = value
    except KeyError:
      raise unknown_field_error(config, key) from None
    except TypeError as e:
      raise ConfigError(key, f"cannot set {value!r}: {e}") from None
  return config


def with_overrides(config, overrides: Mapping[str, Any]):
  """A locked deep copy of `config` with `overrides` applied (apply_overrides); `config` is unchanged."""
  c = apply_overrides(copy.deepcopy(config), overrides)
  c.lock()
  return c


def json_without(config, fields) -> str:
  """`config` as sorted JSON less the dotted `fields` (absent ones ignored): the key of what does not
  depend on them (a candidate group's members, a state initialiser, a validation carve's reading)."""
  flat = json.loads(config.to_json_best_effort())
  for field in fields:
    *sections, name = field.split(".")
    node = flat
    for section in sections:
      node = node.get(section, {})
    node.pop(name, None)
  return json.dumps(flat, sort_keys=True)


def parse_search(spec: str) -> dict:
  """'table.learning_rate*=0.5,1,2;dataset.conversion=a,b' -> {field: (op, [values])}.

  `*=` multiplies the derived value, `=` sets it. Values are parsed as numbers when they are.
  """
  grid = {}
  for part in filter(None, (p.strip() for p in spec.split(";"))):
    field, op, values = (part.partition("*=") if "*=" in part else part.partition("="))
    if not op or not values:
      raise ConfigError("recipe.search", f"{part!r}: expected field=v1,v2 or field*=m1,m2")
    parsed = []
    for v in values.split(","):
      try:
        parsed.append(float(v) if any(c in v for c in ".e") else int(v))
      except ValueError:
        parsed.append(v)
    grid[field.strip()] = (op, parsed)
  return grid
