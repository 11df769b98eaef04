r"""Writes docs/CONFIG.md, the reference of every config field, generated from the config schema.

  python -m experiments.config_reference           # (re)writes docs/CONFIG.md
  python -m experiments.config_reference --check   # exits 1 if docs/CONFIG.md is not what it writes

One table per top-level section of `base_config()` (experiments/configs/common.py), one row per
leaf field, walked on the ConfigDict (placeholders included): the dotted name, the type, the
default, the allowed values and the description. Nothing is listed by hand:
  * the description is the field's comments in the source of `base_config()`: the contiguous
    comment lines directly above its assignment, then the comment on the assignment's line,
    verbatim and joined (decoration rulers such as `# ---- ... ----` dropped). A comment on a
    section's `ConfigDict()` line introduces that section. Editing those comments is how the
    reference changes;
  * the allowed values are the ones the code enforces: every `_one_of(field, value, allowed)`
    check of snm_jax/train/config/validation.py, found in its source and `allowed` evaluated in
    that module (so the constants of builders.py / validation.py are imported, never copied),
    with the condition it is checked under (e.g. task = `retrieval`); the OTHER_CHOICES checked
    another way; and the RECIPE_FIELDS a recipe may leave at "auto" / -1;
  * the renamed fields are overrides.RENAMED_FIELDS.
tests/test_config_reference.py fails when the committed docs/CONFIG.md is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path

from absl import app, flags

from experiments.configs import common
from snm_jax import losses
from snm_jax.train.config import overrides, validation

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "CONFIG.md"
COMMAND = "python -m experiments.config_reference"

_OUTPUT = flags.DEFINE_string("output", None, "Markdown file to write (default: the repository's "
                              "docs/CONFIG.md).")
_CHECK = flags.DEFINE_bool("check", False, "Write nothing; exit 1 if the file differs from what "
                           "would be written.")

# The config-check helper of validation.py whose calls name a field and its allowed values.
CHOICE_CHECK = "_one_of"
# Fields validation.py checks against a fixed set of values other than with CHOICE_CHECK: loss.phi
# is checked by building the surrogate (`losses.get_phi`, which accepts the names in PHIS).
OTHER_CHOICES = {"loss.phi": lambda: tuple(losses.PHIS)}
# A line of only dashes / equals signs at either end of a comment is decoration, not description.
_RULER = re.compile(r"^[-=]{3,}\s*|\s*[-=]{3,}$")


@dataclasses.dataclass(frozen=True)
class Field:
  name: str          # dotted, e.g. "mining.k"
  type_name: str
  default: object
  placeholder: bool  # an ml_collections placeholder: typed, None until set


@dataclasses.dataclass(frozen=True)
class Choices:
  values: tuple
  condition: str = ""  # when the check applies ("" = always), e.g. "task = `retrieval`"


# ---- the fields and their comments ------------------------------------------------------------

def leaf_fields(config) -> list[Field]:
  """Every leaf of `config` (overrides.config_fields' walk), with its type and default."""
  fields = []
  for name in overrides.config_fields(config):
    *path, leaf = name.split(".")
    section = config
    for key in path:
      section = section[key]
    value, declared = section[leaf], section.get_type(leaf)
    placeholder = value is None and declared is not type(None)
    fields.append(Field(name, declared.__name__, value, placeholder))
  return fields


def _comment_text(comment: str) -> str:
  return _RULER.sub("", comment.lstrip("#").strip())


def source_comments(function=common.base_config) -> dict[str, str]:
  """Dotted name -> description, for every `c.a.b = ...` assignment in `function`'s source, in
  source order (sections included): the comment lines directly above it, then the one on its
  line, joined with spaces."""
  source = textwrap.dedent(inspect.getsource(function))
  comments, code_lines = {}, set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = _comment_text(tok.string)
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
      code_lines.update(range(tok.start[0], tok.end[0] + 1))
  own_line = {line for line in comments if line not in code_lines}
  described = []
  for node in ast.walk(ast.parse(source)):
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and _attribute_path(node.targets[0])):
      continue
    above, line = [], node.lineno - 1
    while line in own_line:
      above.insert(0, comments[line])
      line -= 1
    beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
    described.append((node.lineno, _attribute_path(node.targets[0]), " ".join(t for t in above + beside if t)))
  return {name: text for _, name, text in sorted(described)}


def _attribute_path(node) -> str:
  """`c.a.b` -> "a.b" (the attributes after the root name); "" for anything else."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.insert(0, node.attr)
    node = node.value
  return ".".join(parts) if isinstance(node, ast.Name) and parts else ""


# ---- the allowed values -------------------------------------------------------------------------

def enforced_choices(module=validation) -> dict[str, list[Choices]]:
  """Field -> the value sets `module` checks it against: its CHOICE_CHECK calls, each with the
  condition of the `if`s around it (and of the `if ...: return` before it) that test a config
  field against a constant; `given(...)` tests (a recipe's placeholders) are left out."""
  tree = ast.parse(inspect.getsource(module))
  found = {}
  for function in tree.body:
    if not isinstance(function, ast.FunctionDef):
      continue
    namespace = _namespace(module, function)
    for call, guards in _guarded_calls(function.body, ()):
      field = call.args[0]
      if not (isinstance(field, ast.Constant) and isinstance(field.value, str)):
        raise ValueError(f"{module.__name__}:{call.lineno}: {CHOICE_CHECK}'s field is not a string "
                         "literal; experiments/config_reference.py reads the checked field from it")
      expression = compile(ast.Expression(call.args[2]), module.__file__, "eval")
      allowed = eval(expression, namespace)  # pylint: disable=eval-used
      condition = " and ".join(filter(None, (_describe(test, holds, function) for test, holds in guards)))
      found.setdefault(field.value, []).append(Choices(tuple(allowed), condition))
  return found


def _namespace(module, function) -> dict:
  """The names `function`'s code sees: the module's, plus the imports inside the function."""
  namespace = dict(vars(module))
  for node in ast.walk(function):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      exec(compile(ast.Module([node], []), module.__file__, "exec"), namespace)  # pylint: disable=exec-used
  return namespace


def _guarded_calls(statements, guards):
  """(CHOICE_CHECK call, ((test, holds), ...)) for the calls in `statements`."""
  for statement in statements:
    if isinstance(statement, ast.If):
      if not statement.orelse and all(isinstance(s, ast.Return) for s in statement.body):
        guards += ((statement.test, False),)  # the rest of the block runs only when it is false
        continue
      yield from _guarded_calls(statement.body, guards + ((statement.test, True),))
      yield from _guarded_calls(statement.orelse, guards + ((statement.test, False),))
    elif hasattr(statement, "body"):  # for, while, with, try, nested def
      for block in (statement.body, getattr(statement, "orelse", []), getattr(statement, "finalbody", []),
                    *[h.body for h in getattr(statement, "handlers", [])]):
        yield from _guarded_calls(block, guards)
    else:
      for node in ast.walk(statement):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == CHOICE_CHECK:
          yield node, guards


def _describe(test, holds: bool, function) -> str:
  """`kind != "retrieval"` (kind read from config.task), not holding -> "task = `retrieval`";
  "" for a recipe's `given(...)` and for `section is not None` holding (a section older configs
  lack: base_config() has it); anything else as its source."""
  if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "given":
    return ""
  if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
      and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
      and isinstance(test.ops[0], ast.IsNot) == holds):
    return ""
  if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq))
      and isinstance(test.comparators[0], ast.Constant)):
    field = _config_field(test.left, function)
    if field:
      equal = isinstance(test.ops[0], ast.Eq) == holds
      return f"{field} {'=' if equal else '!='} `{test.comparators[0].value}`"
  return ast.unparse(test) if holds else f"not ({ast.unparse(test)})"


def _config_field(node, function) -> str:
  """The config field an expression of `function` reads ("" if none); see _config_path."""
  path = _config_path(node, function)
  return ".".join(path) if path else ""


def _config_path(node, function) -> list[str] | None:
  """`config.a.b`, `field_or_default(config.a, "b", ...)` or a local name assigned one of them ->
  ["a", "b"]; `config` -> []; None for an expression that reads no config field."""
  if isinstance(node, ast.Name):
    if node.id == "config":
      return []
    for assign in ast.walk(function):
      if (isinstance(assign, ast.Assign) and len(assign.targets) == 1
          and isinstance(assign.targets[0], ast.Name) and assign.targets[0].id == node.id):
        return _config_path(assign.value, function)
    return None
  if isinstance(node, ast.Attribute):
    base, leaf = _config_path(node.value, function), node.attr
  elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "field_or_default"
        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
    base, leaf = _config_path(node.args[0], function), node.args[1].value
  else:
    return None
  return None if base is None else [*base, leaf]


def allowed_values(fields: list[Field]) -> dict[str, str]:
  """Field -> the Markdown of its allowed values, for the fields the code restricts."""
  choices = enforced_choices()
  for name, values in OTHER_CHOICES.items():
    choices.setdefault(name, []).append(Choices(tuple(values())))
  defaults = {f.name: f.default for f in fields}
  out = {}
  for name in defaults:
    parts = [(f"when {c.condition}: " if c.condition else "") + ", ".join(_code(v) for v in c.values)
             for c in dict.fromkeys(choices.get(name, []))]
    if name in validation.RECIPE_FIELDS:
      if not parts:
        parts.append(validation.RECIPE_FIELDS[name])
      auto = overrides.AUTO if isinstance(defaults[name], str) else -1
      parts.append(f"{_code(auto)} with a recipe (derived from the data)")
    if parts:
      out[name] = "; ".join(parts)
  return out


# ---- Markdown -----------------------------------------------------------------------------------

def _code(value) -> str:
  """`value` as inline code (strings bare, the rest as repr)."""
  return f"`{value if isinstance(value, str) else repr(value)}`"


def _escape_text(text: str) -> str:
  """Cell text as GitHub shows it literally: Markdown's emphasis, strikethrough, math and HTML
  characters escaped outside `code spans`; `|` escaped everywhere (the table's separator)."""
  pieces = re.split(r"(`[^`]*`)", text)
  for i, piece in enumerate(pieces):
    if i % 2 == 0:
      piece = re.sub(r"([\\*~$])", r"\\\1", piece)
      piece = re.sub(r"<(?=[A-Za-z/!?])|\](?=[(\[])", lambda m: "\\" + m.group(), piece)  # tags, links
      piece = re.sub(r"(?<![A-Za-z0-9])_", r"\\_", piece)  # an intraword _ never opens emphasis
    pieces[i] = piece.replace("|", r"\|")
  return "".join(pieces)


def _cell(markdown: str) -> str:
  """Generated Markdown (code spans already formed) as a table cell."""
  return markdown.replace("|", r"\|")


def _anchor(title: str) -> str:
  return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


TOP_LEVEL = "Top-level fields"  # the section of the leaves outside any section (seed, task)
RENAMED = "Renamed fields"


def _section_of(name: str) -> str:
  return name.split(".")[0] if "." in name else TOP_LEVEL


def render(fields: list[Field], descriptions: dict[str, str], allowed: dict[str, str],
           renamed: dict[str, str]) -> str:
  """The Markdown reference: `fields` in the order of `descriptions` (source order), one table per
  top-level section (the top-level leaves first), each after its sections' own descriptions."""
  order = {name: i for i, name in enumerate(descriptions)}
  fields = sorted(fields, key=lambda f: order.get(f.name, len(order)))
  leaves = {f.name for f in fields}
  sections = {TOP_LEVEL: []} if any(_section_of(f.name) == TOP_LEVEL for f in fields) else {}
  for f in fields:
    sections.setdefault(_section_of(f.name), []).append(f)
  lines = [
      "# Config reference",
      "",
      f"<!-- Generated by `{COMMAND}` from experiments/configs/common.py: do not edit. -->",
      "",
      f"Generated by `{COMMAND}` from `base_config()` in "
      "[experiments/configs/common.py](../experiments/configs/common.py); do not edit it by hand. "
      "Each description is the field's comment in common.py (the lines directly above it and the "
      "one beside it): to change one, edit that comment and rerun the command. "
      f"`tests/test_config_reference.py` (and `{COMMAND} --check`) fail while this file is stale.",
      "",
      "Every experiment config starts from `base_config()` and overrides fields; any field can "
      "also be set on the command line, e.g. `--config.mining.k=16`. *Allowed* lists the values "
      "snm_jax/train/config/validation.py accepts where it restricts a field to a set, and the "
      "fields a recipe may leave for it to derive from the data. A placeholder is typed but unset "
      "(`None`) until given.",
      "",
      f"{len(fields)} fields in {len(sections)} sections: "
      + " · ".join(f"[{title}](#{_anchor(title)})" for title in [*sections, RENAMED]),
  ]
  for title, members in sections.items():
    lines += ["", f"## {title}", ""]
    for name, text in descriptions.items():  # the section's and its subsections' own comments
      if text and name not in leaves and name.split(".")[0] == title:
        lines += [(f"`{name}`: " if name != title else "") + _escape_text(text), ""]
    lines += ["| Field | Type | Default | Allowed | Description |", "|---|---|---|---|---|"]
    for f in members:
      type_name = f"{f.type_name} (placeholder)" if f.placeholder else f.type_name
      lines.append(f"| `{f.name}` | {type_name} | {_cell(f'`{f.default!r}`')} | "
                   f"{_cell(allowed.get(f.name, ''))} | {_escape_text(descriptions.get(f.name, ''))} |")
  lines += ["", f"## {RENAMED}", "",
            "The old names are refused wherever a field is named, with the new name in the message "
            "(RENAMED_FIELDS in snm_jax/train/config/overrides.py).", "",
            "| Old name | New name |", "|---|---|"]
  lines += [f"| `{old}` | `{new}` |" for old, new in renamed.items()]
  return "\n".join(lines) + "\n"


def generate() -> str:
  """The text of docs/CONFIG.md for the current code."""
  fields = leaf_fields(common.base_config())
  return render(fields, source_comments(), allowed_values(fields), overrides.RENAMED_FIELDS)


def stale_message(path: Path, text: str) -> str | None:
  """None if `path` holds `text`, else what is wrong and the command that fixes it."""
  command = COMMAND if path.resolve() == REFERENCE else f"{COMMAND} --output={path}"
  if not path.is_file():
    return f"{path} does not exist: generate it with `{command}`"
  if path.read_text() != text:
    return f"{path} is stale (it differs from the config schema): regenerate it with `{command}`"
  return None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  path = Path(_OUTPUT.value) if _OUTPUT.value else REFERENCE
  text = generate()
  if _CHECK.value:
    problem = stale_message(path, text)
    if problem:
      sys.exit(problem)
    print(f"{path} is up to date")
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
