"""Pictures: ``python -m zerompi.plot RUN.json ... [--out PNG]`` and ``zerompi.bench --plot PNG``.

The figures are checked on matplotlib's objects (axes, their titles, the lines and bars and
their labels and data), never on pixels; the files must be written and be PNG images. A
wrong JSON is one line and exit status 2. The plot command runs where mpi4py cannot be
imported, and imports matplotlib only to draw.
"""
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.mpirun import ROOT, no_python_noise, run_mpi, run_train, zerompi_lines
from tests.test_architecture import BLOCK_MPI
from zerompi.plot import figure as plot

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib (the plot extra) is not installed: pip install -e '.[plot]'")
PNG = b"\x89PNG\r\n\x1a\n"
GPT = ["--model", "gpt", "--n-layer", "2", "--d-model", "32", "--seq-len", "16", "--batch", "6", "--steps", "6",
       "--eval-every", "3"]
MLP = ["--model", "mlp", "--stage", "3", "--width", "32", "--depth", "3", "--batch", "12", "--steps", "5",
       "--bucket-mb", "0.002"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(paths, metrics) of a short GPT run (stage 2) and a short MLP run (stage 3), 2 ranks each."""
    tmp = tmp_path_factory.mktemp("plot")
    gpt = run_train(2, tmp, *GPT, tag="gpt")
    mlp = run_train(2, tmp, *MLP, tag="mlp")
    return [tmp / "gpt.json", tmp / "mlp.json"], [gpt, mlp]


def python(*args, block_mpi=True, code=None):
    """Run ``python -m zerompi.plot ARGS`` (or ``code``) with mpi4py made unimportable."""
    run = code or "import runpy; sys.argv = ['zerompi.plot'] + sys.argv[1:]; runpy.run_module('zerompi.plot', " \
                  "run_name='__main__')"
    cmd = [sys.executable, "-c", (BLOCK_MPI if block_mpi else "import sys; ") + run, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(ROOT))


def by_title(fig):
    return {ax.get_title(): ax for ax in fig.axes}


@needs_matplotlib
def test_one_run_figure_has_its_axes_and_series(runs):
    (path, _), (m, _) = runs
    names = plot.labels([m], [str(path)])
    assert names == ["gpt, stage 2, fp16, N=2, unquantized"]
    ax = by_title(plot.figure([m], names))
    assert set(ax) == set(plot.TITLES)
    loss = {line.get_label(): line for line in ax["loss"].get_lines()}
    train, held = loss[f"{names[0]}: train"], loss[f"{names[0]}: held-out"]
    assert list(train.get_ydata()) == m["losses"] and list(train.get_xdata()) == list(range(1, 7))
    assert [list(p) for p in zip(held.get_xdata(), held.get_ydata())] == m["val_losses"]
    floor = next(line for label, line in loss.items() if label.startswith("entropy floor"))
    assert floor.get_linestyle() == "--" and floor.get_ydata()[0] == pytest.approx(m["entropy_floor"])
    tput, = ax["throughput"].get_lines()
    want = [m["config"]["batch"] * m["config"]["seq_len"] / t for t in m["step_times_s"]]
    np.testing.assert_allclose(tput.get_ydata(), want)
    assert ax["throughput"].get_ylabel() == "tokens/s"
    stacks = ax["step time"].collections                      # stackplot: one area per part, per step
    assert [c.get_label() for c in stacks] == ["forward", "backward", "optimizer", "waiting", "other"]
    bars = ax["memory per rank"].containers
    assert [b.get_label() for b in bars] == [f"{names[0]}: measured", f"{names[0]}: formula"]
    rows = [t.get_text() for t in ax["memory per rank"].get_xticklabels()]
    assert rows == ["params", "grads", "optimizer", "total"]
    unit = 2 ** 10 if ax["memory per rank"].get_ylabel().startswith("KiB") else 2 ** 20
    assert [p.get_height() * unit for p in bars[0]] == pytest.approx([m["memory_bytes"][r] for r in rows])
    assert [p.get_height() * unit for p in bars[1]] == pytest.approx([m["theory_bytes_padded"][r] for r in rows])


@needs_matplotlib
def test_several_runs_overlay_labelled(runs):
    paths, ms = runs
    names = plot.labels(ms, [str(p) for p in paths])
    assert names == ["gpt, stage 2", "mlp, stage 3"]          # what sets them apart
    ax = by_title(plot.figure(ms, names))
    labels = [line.get_label() for line in ax["loss"].get_lines()]
    assert "gpt, stage 2: train" in labels and "mlp, stage 3: train" in labels
    assert sum(label.startswith("entropy floor") for label in labels) == 1     # the GPT's only
    assert [line.get_label() for line in ax["throughput"].get_lines()] == names
    bars = ax["step time"].containers                         # a stacked bar per run, a container per part
    assert len(bars) == 2 * len(plot.PARTS) and all(len(b) == 1 for b in bars)
    assert [t.get_text() for t in ax["step time"].get_xticklabels()] == names
    assert len(ax["memory per rank"].containers) == 4


def test_labels_fall_back_to_file_names():
    m = {"model": "mlp", "stage": 2, "dtype": "fp32", "world_size": 2}
    assert plot.labels([m, dict(m)], ["a/one.json", "b/two.json"]) == ["one.json", "two.json"]


@needs_matplotlib
def test_plot_command_writes_a_png_without_mpi(runs, tmp_path):
    (gpt, mlp), _ = runs
    out = tmp_path / "fig.png"
    proc = python(gpt, mlp, "--out", out)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    proc = python(gpt)                                        # the default: RUN.png beside RUN.json
    assert proc.returncode == 0 and gpt.with_suffix(".png").read_bytes().startswith(PNG), proc.stderr


def test_plot_module_imports_neither_mpi_nor_matplotlib():
    proc = python(code="import zerompi.plot.figure; print(sorted(m for m in sys.modules "
                       "if m.split('.')[0] in ('mpi4py', 'matplotlib')))")
    # the blocker's None
    assert proc.returncode == 0 and proc.stdout.strip() == "['mpi4py']", proc.stdout + proc.stderr


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not JSON"),
    ('[{"op": "all_gather"}]', "a JSON list (zerompi.bench --json records?)"),
    ('"text"', "a JSON str"),
    ('{"losses": [1.0]}', "not a zerompi.train --metrics-json file (no model, stage"),
    (None, "cannot be read"),
])
def test_plot_command_rejects_a_wrong_json_in_one_line(tmp_path, content, needle):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    proc = python(path, "--out", tmp_path / "x.png")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("zerompi.plot: error: ") and str(path) in lines[0] and needle in lines[0], lines
    assert not (tmp_path / "x.png").exists()


def test_plot_command_rejects_bad_arguments(tmp_path):
    for args in ([], [tmp_path / "r.json", "--out", tmp_path / "no-such-folder" / "x.png"]):
        proc = python(*args)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ---- the benchmark's picture ----------------------------------------------------------------
@needs_matplotlib
def test_bench_plot_draws_busbw_per_implementation(tmp_path):
    png, records = tmp_path / "bw.png", tmp_path / "bw.json"
    run_mpi(2, ["-m", "zerompi.bench", "-b", "64K", "-e", "256K", "--iters", "2", "--warmup", "1", "--no-overlap",
                "--plot", png, "--json", records], timeout=120)
    assert png.read_bytes().startswith(PNG)
    from zerompi.bench.plot import busbw_figure
    recs = json.loads(records.read_text())
    ax = by_title(busbw_figure(recs))
    assert set(ax) == {"reduce_scatter", "all_gather", "all_reduce"}
    for op, a in ax.items():
        lines = {line.get_label(): line for line in a.get_lines()}
        assert set(lines) == {"zerompi", "mpi", "copy ceiling"}
        assert lines["copy ceiling"].get_linestyle() == "--" and lines["mpi"].get_linestyle() == "-"
        rows = sorted((r["bytes"], r["busbw"]) for r in recs if r["op"] == op and r["impl"] == "zerompi")
        assert list(lines["zerompi"].get_xdata()) == [b for b, _ in rows]
        assert list(lines["zerompi"].get_ydata()) == [bw for _, bw in rows]
        assert a.get_xscale() == "log"


def test_bench_plot_path_is_checked_at_start(tmp_path):
    proc = run_mpi(2, ["-m", "zerompi.bench", "-b", "64K", "-e", "64K", "--plot", tmp_path / "nope" / "bw.png"],
                   timeout=60, check=False)
    lines = zerompi_lines(proc.stderr)     # zerompi's own lines: a launcher may add its banner
    no_python_noise(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "plot=" in lines[0], proc.stderr
