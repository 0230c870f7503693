"""Each package's docstring indexes it (issue 38 item 6): every module and subpackage, by name,
with its one concern on one line, so that a reader finds a concept by its module.

An index is a section headed `Modules...:` or `Packages...:`, then one line per member:
two spaces, the name, two or more spaces, what it is.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("wus", "analysis", "transforms", "collectives", "harness")
# wus/checkpoint's docstring is docs/api.md's page on checkpoints: prose, not an index.
UNINDEXED = {"wus/checkpoint"}
HEADER = re.compile(r"(Modules|Packages)\b.*:$")
ENTRY = re.compile(r"  (\w+) {2,}\S")


def _packages() -> list[str]:
  """Every package folder of the library and the harness, relative to the repository."""
  found = [p.parent.relative_to(ROOT).as_posix() for f in FOLDERS
           for p in sorted((ROOT / f).rglob("__init__.py"))]
  return [p for p in found if p not in UNINDEXED]


def members(package: pathlib.Path) -> set[str]:
  """The modules and subpackages of a package folder."""
  modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
  return modules | {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}


def index(doc: str) -> tuple[list[str], list[str]]:
  """(the names a docstring's index sections list, in order; their lines that are no entry)."""
  names, bad, inside = [], [], False
  for line in doc.splitlines():
    if HEADER.fullmatch(line):
      inside = True
    elif inside and line.startswith(" "):
      entry = ENTRY.match(line)
      names += [entry.group(1)] if entry else []
      bad += [] if entry else [line]
    else:
      inside = False
  return names, bad


def test_index_reads_names_and_refuses_lines_that_are_no_entry():
  doc = ("Title.\n\nModules, one concern each:\n  a    one\n  bc   two\n       more\n"
         "Packages:\n  d  x\n\n  e  y")
  assert index(doc) == (["a", "bc", "d"], ["       more"])


@pytest.mark.parametrize("package", _packages())
def test_package_index_lists_every_module_once(package):
  folder = ROOT / package
  doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
  names, bad = index(doc)
  assert names, f"{package}/__init__.py has no module index"
  assert not bad, f"{package}/__init__.py: index lines that are no one-line entry: {bad}"
  assert len(names) == len(set(names)), f"{package}/__init__.py lists a module twice: {names}"
  have = members(folder)
  assert not have - set(names), f"{package}/__init__.py omits {sorted(have - set(names))}"
  assert not set(names) - have, f"{package}/__init__.py lists no module {sorted(set(names) - have)}"


def test_every_library_and_harness_package_is_checked():
  assert {"wus", "analysis", "analysis/compat", "transforms", "collectives", "harness",
          "harness/tools/bench"} <= set(_packages())
