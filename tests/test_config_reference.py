"""docs/CONFIG.md is the reference `python -m experiments.config_reference` generates from
base_config(): committed up to date, listing every field, each with a description; and the
generator's readers (comments, validation.py's checks, --check) do what they say."""

import ml_collections
import pytest

from experiments import config_reference
from experiments.configs import common
from snm_jax.train.config import builders, overrides, validation

REGENERATE = f"regenerate it with `{config_reference.COMMAND}` and commit docs/CONFIG.md"


@pytest.fixture(scope="module")
def generated():
  return config_reference.generate()


@pytest.fixture(scope="module")
def fields():
  return overrides.config_fields(common.base_config())


def test_committed_reference_is_up_to_date(generated):
  problem = config_reference.stale_message(config_reference.REFERENCE, generated)
  assert problem is None, f"{problem}\n(the config schema or its comments changed: {REGENERATE})"


def test_every_leaf_field_is_in_the_reference(fields):
  committed = config_reference.REFERENCE.read_text()
  missing = [name for name in fields if f"| `{name}` |" not in committed]
  assert not missing, f"docs/CONFIG.md has no row for {missing}: {REGENERATE}"
  assert len(fields) > 100  # the walk reached the nested sections


def test_every_field_has_a_description(fields):
  descriptions = config_reference.source_comments()
  undescribed = [name for name in fields if not descriptions.get(name)]
  assert not undescribed, (f"fields without a comment in experiments/configs/common.py base_config(): "
                           f"{undescribed}; add one above or beside each assignment")


def test_placeholders_are_listed_with_their_type():
  by_name = {f.name: f for f in config_reference.leaf_fields(common.base_config())}
  field = by_name["model.normalize_classes"]  # ml_collections.config_dict.placeholder(bool)
  assert (field.placeholder, field.type_name, field.default) == (True, "bool", None)
  assert not by_name["mining.k"].placeholder


def test_checked_fields_exist(fields):
  """Every field validation.py restricts (and OTHER_CHOICES, RECIPE_FIELDS) is a base_config()
  field, so none of their allowed values is dropped from the reference."""
  checked = {*config_reference.enforced_choices(), *config_reference.OTHER_CHOICES, *validation.RECIPE_FIELDS}
  assert checked - set(fields) == set()


def test_allowed_values_are_the_code_constants():
  choices = config_reference.enforced_choices()
  assert choices["model.kind"] == [config_reference.Choices(builders.MODEL_KINDS)]
  assert choices["table.optimizer"] == [config_reference.Choices(validation.TABLE_OPTIMIZERS)]
  # Checked only after _validate_task's `if kind != "retrieval": return` (kind = the task field).
  assert [c.condition for c in choices["dataset.name"]] == ["task = `retrieval`"]
  assert [c.condition for c in choices["distributed.initialize"]] == [""]  # `dist is not None`: present


def _example_config():
  c = ml_collections.ConfigDict()
  # Above, first line;
  # second line (Eq. 3).
  c.a = 1  # Beside.

  # Separated by a blank line: not a.b's.

  c.b = 2
  c.s = ml_collections.ConfigDict()  # A section.
  c.s.x = "y"  # ---- decorated ----
  c.s.z = ml_collections.config_dict.placeholder(int)
  return c


def test_descriptions_are_the_comments_above_and_beside():
  assert config_reference.source_comments(_example_config) == {
      "a": "Above, first line; second line (Eq. 3). Beside.",
      "b": "",
      "s": "A section.",
      "s.x": "decorated",
      "s.z": "",
  }


def test_cells_escape_markdown():
  escape = config_reference._escape_text  # pylint: disable=protected-access
  assert escape("a | b `x|y*z` c*d") == r"a \| b `x\|y*z` c\*d"
  assert escape("p ~ q <b> lr_t _x") == r"p \~ q \<b> lr_t \_x"


def test_check_reports_a_stale_or_missing_file(tmp_path, generated):
  path = tmp_path / "CONFIG.md"
  assert "does not exist" in config_reference.stale_message(path, generated)
  path.write_text(generated.replace("| `mining.k` |", "| `mining.kk` |"))
  assert config_reference.COMMAND in config_reference.stale_message(path, generated)
  path.write_text(generated)
  assert config_reference.stale_message(path, generated) is None
