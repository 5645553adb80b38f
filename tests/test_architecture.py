"""The package's shape: subpackages in layers, imports one way, no cycles, small modules, and
the offline tools (estimate, checkpoint inspect / consolidate) running where mpi4py cannot be
imported. Read from the source with ``ast``: every import counts, those inside functions too."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpirun import ROOT, run_train

PACKAGE = ROOT / "zerompi"
# Each layer may import from itself and the layers above it (train, bench and plot: not from each other).
# inputs: the checked reading of a file the user names (a schedule, a run's metrics, the data), on errors only.
# flags, strict: the configs' command-line flags and typing rule, on errors only.
# pipeline: above the engine (its executor drives ZeroEngines), below estimate (which simulates its schedules; its
# schedule modules import no MPI: test_estimate_runs_without_mpi).
LAYERS = [{"errors"}, {"flags", "strict", "inputs"}, {"layout"}, {"optim"}, {"comm"}, {"checkpoint"}, {"engine"},
          {"pipeline"}, {"estimate"}, {"train", "bench", "plot", "data"}, {"run"}]
MAX_LINES = 400
BLOCK_MPI = "import sys; sys.modules['mpi4py'] = None; "   # importing mpi4py now raises ImportError


def modules():
    """{dotted module name: path} of every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path):
    """The zerompi modules ``name`` imports (resolved to modules, not names inside them)."""
    known = modules()
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.startswith("zerompi") and t != name:
                found.add(t)
    return found


def graph():
    return {name: imports_of(name, path) for name, path in modules().items()}


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_subpackages_import_only_from_their_layer_and_above():
    bad = []
    for name, deps in graph().items():
        if name == "zerompi":          # the public API: lazy, by name
            continue
        for dep in deps:
            if dep == "zerompi":
                bad.append(f"{name} imports the top-level package")
            elif layer(dep) > layer(name) or (layer(dep) == layer(name) and dep.split(".")[1] != name.split(".")[1]):
                bad.append(f"{name} -> {dep}")
    assert not bad, bad


def test_no_import_cycles():
    g = graph()
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_subpackage_inits_import_nothing_but_say_what_lives_there():
    for init in PACKAGE.glob("*/__init__.py"):
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree)
        assert doc and ("May import" in doc or init.parent.name == "models"), init
        if init.parent.name != "estimate":      # the estimate package is callable: it imports its function
            assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body), init


def test_no_module_is_long():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_engine_parts_are_objects_not_mixins():
    from zerompi import ZeroEngine
    from zerompi.engine.gatherer import ParameterGatherer
    from zerompi.engine.reducer import GradientReducer
    assert ZeroEngine.__bases__ == (object,)
    assert not any("Mixin" in n for m in modules() for n in dir(sys.modules.get(m, object())))
    assert GradientReducer.__bases__ == ParameterGatherer.__bases__ == (object,)


def python(code: str, *args, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", BLOCK_MPI + code, *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=str(ROOT))
    assert not check or proc.returncode == 0, proc.stderr
    return proc


def test_the_blocker_blocks():
    proc = python("import mpi4py", check=False)
    assert proc.returncode != 0 and "import of mpi4py halted" in proc.stderr


def test_estimate_runs_without_mpi():
    run = ("import runpy; sys.argv = ['zerompi.estimate'] + sys.argv[1:]; "
           "runpy.run_module('zerompi.estimate', run_name='__main__')")
    out = python(run, "--params", "10e9", "--ranks", "64").stdout
    assert "stage" in out and "16Ψ/N" in out
    out = python(run, "--pp", "4", "--micro-batches", "8", "--schedule", "zb-h1").stdout
    assert "bubble fraction        0.1111" in out, out
    out = python("import zerompi; print(zerompi.estimate(params=1e9, ranks=8)['stages'][3]['formula'])").stdout
    assert out.strip() == "16Ψ/N"
    loaded = python("import zerompi, zerompi.estimate; print(sorted(m for m in sys.modules if 'mpi4py' in m))").stdout
    assert loaded.strip() == "['mpi4py']", loaded      # only the blocker's None


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offline")
    run_train(2, tmp, "--model", "mlp", "--width", "16", "--depth", "2", "--batch", "4", "--steps", "1",
              "--save-dir", tmp / "ck")
    return tmp / "ck"


def test_checkpoint_tools_run_without_mpi(checkpoint_dir, tmp_path):
    run = ("import runpy; sys.argv = ['zerompi.checkpoint'] + sys.argv[1:]; "
           "runpy.run_module('zerompi.checkpoint', run_name='__main__')")
    out = python(run, "inspect", checkpoint_dir).stdout
    assert "world size 2" in out and "shard_00001.npy" in out, out
    python(run, "consolidate", checkpoint_dir, tmp_path / "full.npz")
    import numpy as np
    assert len(np.load(tmp_path / "full.npz").files) > 0
