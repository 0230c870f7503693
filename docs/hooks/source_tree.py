"""mkdocs hook: the installed layout of wus's sources, for mkdocstrings to read statically.

pyproject.toml installs analysis/, transforms/, collectives/ and harness/ as wus.analysis,
wus.transforms, ... (setuptools package-dir); griffe looks for a package's subpackages
inside the package's own folder. This hook lays out build/docs_src/wus/ as the installed
package is laid out (a copy of the checkout's sources at each build: griffe does not walk
into symbolic links to folders), and mkdocs.yml's mkdocstrings `paths` points there, so the
API reference reads the checkout's sources as they are, never an installed copy.
"""

import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "docs_src"
SUBPACKAGES = ("analysis", "transforms", "collectives", "harness")


def on_startup(command, dirty):
  """Lays out the tree before any plugin reads its config: mkdocstrings resolves its
  `paths` in its own on_config, which runs before a hook's (a fresh checkout, with no
  build/ yet, failed to resolve `wus.Plan` when this ran in on_config)."""
  del command, dirty
  package = TREE / "wus"
  shutil.rmtree(TREE, ignore_errors=True)
  ignore = shutil.ignore_patterns("__pycache__")
  shutil.copytree(ROOT / "wus", package, ignore=ignore)
  for name in SUBPACKAGES:
    shutil.copytree(ROOT / name, package / name, ignore=ignore)
