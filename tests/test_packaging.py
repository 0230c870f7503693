"""The library's dependencies are the library's (issue 32): `import wus` loads neither Flax,
Orbax nor Equinox, the names that need them import them when used, and everything the library
imports on `import wus` is the standard library or a dependency `pip install wus` installs."""

import ast
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The library's packages (not the harness, which `wus[harness]` installs the dependencies of).
LIBRARY = ("wus", "analysis", "transforms", "collectives")
# Modules that import an optional library on purpose, loaded only when their names are used.
OPTIONAL = {"wus/nnx.py": "flax", "wus/checkpoint": "orbax-checkpoint"}


def _run(code: str) -> str:
  result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


def test_import_wus_loads_no_flax_orbax_or_equinox():
  out = _run("""
      import sys
      import wus
      heavy = ("flax", "orbax", "equinox", "tensorstore", "optax")
      print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
      """)
  assert out.strip() == "[]", out


def test_lazy_names_still_work():
  out = _run("""
      import sys
      import wus
      from wus import nnx_jit
      import wus.nnx
      assert nnx_jit is wus.nnx_jit is wus.nnx.nnx_jit
      assert "flax" in sys.modules and "orbax" not in sys.modules
      assert wus.checkpoint.LogicalView.__module__ == "wus.checkpoint.views"
      assert "orbax" in sys.modules
      assert {"nnx_jit", "checkpoint"} <= set(dir(wus)), dir(wus)
      assert all(hasattr(wus, name) for name in wus.__all__)
      print("ok")
      """)
  assert out.strip() == "ok"


def test_a_lazy_name_whose_library_is_missing_says_what_to_install():
  """Where Flax is missing, `wus.nnx_jit` is a stand-in: using it (calling it, or reading an
  attribute) raises the ImportError that names what to install."""
  out = _run("""
      import sys
      sys.modules["flax"] = None  # As if Flax were not installed.
      import wus
      step = wus.nnx_jit
      for use in (lambda: step(print), lambda: step.plan, lambda: wus.nnx_jit(print)):
        try:
          use()
        except ImportError as e:
          print(e)
      """)
  lines = out.strip().splitlines()
  assert len(lines) == 3, out
  assert all("wus.nnx_jit needs flax" in ln and "pip install flax" in ln for ln in lines), out


def test_help_and_dir_work_without_flax_and_orbax():
  """Issue 39: `help(wus)` after `pip install .` printed only the ImportError of
  `wus.checkpoint` (pydoc reads every name). Without Flax and Orbax importable, it prints
  the module docstring with its example, and lists the names those libraries serve."""
  out = _run("""
      import sys
      for name in ("flax", "orbax", "orbax.checkpoint", "tensorstore"):
        sys.modules[name] = None  # As if only `pip install .` had run.
      import wus
      help(wus)
      print(sorted(set(wus.__all__) - set(dir(wus))))
      """)
  assert "Help on package wus" in out, out
  for line in ('mesh = jax.make_mesh((8,), ("data",)',
               'batch = jax.device_put(batch, NamedSharding(mesh, P("data")))',
               "@wus.jit                                  # was: @jax.jit",
               "print(wus.bytes_per_device(opt_state))"):
    assert line in out, line
  assert "nnx_jit = <wus.nnx_jit: needs flax, not installed>" in out, out
  assert "checkpoint = <wus.checkpoint: needs orbax-checkpoint, not installed>" in out, out
  assert out.strip().splitlines()[-1] == "[]", out


def test_an_unknown_name_is_an_attribute_error():
  out = _run("""
      import wus
      print(hasattr(wus, "no_such_name"))
      """)
  assert out.strip() == "False"


def _module_level_imports(path: pathlib.Path) -> set[str]:
  """Top-level names of the absolute imports a file runs when imported (not those inside
  functions, which run when the function is called)."""
  names = set()

  def visit(node):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      return
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module.split(".")[0])
    for child in ast.iter_child_nodes(node):
      visit(child)

  visit(ast.parse(path.read_text(), str(path)))
  return names


def _requirement_names(requirements: list[str]) -> set[str]:
  return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_library_imports_only_its_dependencies():
  """A module the library imports is the standard library, wus, or a `dependencies` entry
  (optional libraries only in the modules of `OPTIONAL`, which `import wus` does not load)."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  required = _requirement_names(project["dependencies"])
  provides = {"jax": "jax", "jaxlib": "jaxlib", "numpy": "numpy", "optax": "optax",
              "absl": "absl-py"}
  missing = {}
  for package in LIBRARY:
    for path in sorted((ROOT / package).rglob("*.py")):
      rel = path.relative_to(ROOT).as_posix()
      if any(rel == m or rel.startswith(m + "/") for m in OPTIONAL):
        continue
      for name in _module_level_imports(path) - set(sys.stdlib_module_names) - {"wus"}:
        if provides.get(name) not in required:
          missing.setdefault(rel, set()).add(name)
  assert not missing, f"imports of libraries pip install wus does not install: {missing}"
  harness_only = {"flax", "orbax-checkpoint", "scikit-learn", "pillow", "tensorboardx",
                  "matplotlib", "tqdm", "equinox"}
  assert not required & harness_only, required & harness_only
  extras = {k: _requirement_names(v) for k, v in project["optional-dependencies"].items()}
  assert {"flax", "orbax-checkpoint"} <= extras["harness"]
  assert "wus" in extras["test"] and "equinox" in extras["test"]  # wus[harness] and more.


def test_the_api_reference_documents_every_public_name():
  """docs/api.md has an entry (`::: wus.X`) for every name of `wus.__all__`; `mkdocs build
  --strict` (.ci/run) then fails for an entry whose docstring does not render."""
  import wus  # noqa: PLC0415
  entries = set(re.findall(r"^::: wus\.(\w+)", (ROOT / "docs" / "api.md").read_text(), re.M))
  assert set(wus.__all__) <= entries, set(wus.__all__) - entries


def test_the_harness_says_to_install_its_extra_where_a_dependency_is_missing():
  out = _run("""
      import sys
      sys.modules["tensorboardX"] = None  # As if only `pip install wus` had run.
      try:
        import wus.harness.training.train
      except ModuleNotFoundError as e:
        print(e)
      """)
  assert "needs tensorboardX" in out and 'pip install "wus[harness]"' in out, out
