"""One runtime for every front end (issue 38 item 1), checked on the source.

Each front end translates its calling convention to `wus.runtime` (`call`, `lower`,
`state_target`, `compiled_once`); none runs, lowers or makes the restore targets of a
compiled step with a body of its own, and `wus.pmap` builds its own `pipeline.Step`
(JAX's pmap is `jit(shard_map)` at the pipeline's level), not `wus.shard_map`'s class.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FRONT_ENDS = ("api", "jit", "pmap", "nnx", "filter_jit", "named_jit", "pjit")
# What only the runtime calls: it wraps outputs kept sharded, and makes restore targets.
RUNTIME_CALLS = frozenset({"ShardedArray", "restore_target"})


def _own_runtime(tree: ast.AST) -> list[str]:
  """Where a module runs, lowers or restores a compiled step itself: it calls the step's
  program (`compiled.step(...)`, `compiled.step.lower(...)`, `.trace`, `.compile`), wraps
  outputs in `ShardedArray`s or makes restore targets."""
  found = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr == "step":
      found.append(f"line {node.lineno}: runs a compiled step's program")
    elif (isinstance(f, ast.Attribute) and f.attr in ("lower", "trace", "compile")
          and isinstance(f.value, ast.Attribute) and f.value.attr == "step"):
      found.append(f"line {node.lineno}: {f.attr}s a compiled step's program")
    elif (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) in RUNTIME_CALLS:
      found.append(f"line {node.lineno}: calls what the runtime calls")
  return found


def test_the_check_sees_a_runtime_body():
  """The bodies the front ends had before the runtime ran them all."""
  for body in ("outs = compiled.step(*runtime.operands(leaves, compiled))",
               "compiled.step.lower(*ops)", "self._jit.step.trace(*ops)",
               "ShardedArray(x, compiled.sharded_outputs[k])",
               "checkpoint.restore_target(compiled.sharded_leaves[k], x.dtype)"):
    assert _own_runtime(ast.parse(body)), body
  assert not _own_runtime(ast.parse("runtime.lower(leaves, compiled)"))


def test_no_front_end_runs_lowers_or_restores_a_step_itself():
  found = {}
  for name in FRONT_ENDS:
    path = ROOT / "wus" / f"{name}.py"
    if where := _own_runtime(ast.parse(path.read_text(), str(path))):
      found[path.name] = where
  assert not found, f"front ends with a runtime body of their own (use wus.runtime's): {found}"


def test_pmap_builds_no_sharded_step():
  """`wus.pmap` is `jit(shard_map)` at the pipeline's level: it imports nothing of
  `wus.api` and names no `ShardedStep`."""
  tree = ast.parse((ROOT / "wus" / "pmap.py").read_text())
  imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
  imports += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  assert "wus.api" not in imports and "wus" in {m.split(".")[0] for m in imports if m}
  names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
  names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
  names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
  assert "Step" in names  # The check sees names: pmap builds `pipeline.Step`.
  assert "ShardedStep" not in names and "api" not in names
