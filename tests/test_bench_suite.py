"""scripts/bench_suite.py: the rows' ratio, goal and met on hand-made inputs (hand-computed values), each
script's JSON turned into its rows, the Markdown and plot writer, one real path end to end (a finite ratio,
never a timing), bad input, and (slow) --check: every path runs at its smallest size and its bits hold."""
import json
import math
import subprocess
import sys

import pytest

from tests.mpirun import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_suite  # noqa: E402
import suite_doc  # noqa: E402
import suite_rows as sr  # noqa: E402

FIELDS = {"name", "measured", "floor", "ratio", "goal", "unit", "met"}
DEBTS = ("gpt_vs_gemm", "check_1mib_all_gather", "check_1mib_reduce_scatter", "zeropp_4x1", "nvme_vs_io",
         "bubble_1f1b_pp2_dp2", "bubble_zbh1")


def test_row_ratio_goal_and_met():
    r = sr.row("x", 3.0, 2.0, 1.6, "µs", extra=7)
    assert FIELDS <= set(r) and r["ratio"] == 1.5 and r["met"] is True and r["unit"] == "µs" and r["extra"] == 7
    assert sr.row("x", 3.0, 2.0, 1.4)["met"] is False
    assert sr.row("x", 3.0, 2.0, 1.5)["met"] is True          # the goal is a bound the ratio may reach
    assert sr.row("x", 3.0, 2.0)["met"] is None and sr.row("x", 3.0, 2.0)["goal"] is None
    for bad in (sr.row("x", 3.0, 0.0, 1.0), sr.row("x", math.nan, 2.0, 1.0), sr.row("x", 1.0, math.inf, 1.0)):
        assert bad["ratio"] is None and bad["met"] is None
    s = sr.skipped("zeropp_4x1", "no namespaces", 0.35)
    assert FIELDS <= set(s) and s["skipped"] == "no namespaces" and s["ratio"] is None and s["goal"] == 0.35


def test_each_scripts_json_becomes_its_rows():
    rows, checks = sr.floor_rows([{"model": "gpt-default", "N": 1}, {
        "model": "gpt-6x256", "N": 1, "floor_s": 0.5, "fwd_bwd_over_floor": 1.1, "stages_bit_identical": True,
        "stages": {"0": {"step_s": 0.6, "over_floor": 1.19, "breakdown_s": {"forward": 0.3, "other": 0.06}},
                   "3": {"step_s": 0.7}}}])
    assert rows[0]["name"] == "gpt_vs_gemm" and rows[0]["ratio"] == pytest.approx(1.2) and rows[0]["goal"] == 1.15
    assert rows[0]["met"] is False and rows[0]["step_shares"] == {"forward": 0.5, "other": 0.1} and checks[0]["ok"]
    one = {"model": "gpt-6x256", "N": 1, "floor_s": 1.0, "fwd_bwd_over_floor": 1.0, "stages_bit_identical": True,
           "stages": {"0": {"step_s": 1.1, "over_floor": 1.1, "breakdown_s": {"other": 0.0}}}}
    assert sr.floor_rows([one])[1] == []        # one stage: no parity to claim

    rows, _ = sr.signature_rows({"cases": [{"op": "all_gather", "bytes": 1 << 20, "checked_us": 51.0,
                                            "unchecked_us": 50.0, "best_ratio": 1.0}]})
    assert rows[0]["name"] == "check_1mib_all_gather" and rows[0]["ratio"] == pytest.approx(1.02)
    assert rows[0]["met"] is True

    rows, _ = sr.check_floor_rows({"records": [{"bytes": 64 << 20, "mpi_us": 40.0, "checked_us": 41.0,
                                                "data_only_us": 39.5, "ratio": 1.01}]})
    assert rows[0]["name"] == "check_c_64mib_all_gather" and rows[0]["ratio"] == pytest.approx(1.025)
    assert rows[0]["met"] is False and rows[0]["round_ratio"] == 1.01 and rows[0]["data_only_us"] == 39.5

    rec = lambda op, impl, b, t: {"op": op, "impl": impl, "bytes": b, "time_us": t, "wrong": 0}  # noqa: E731
    rows, checks = sr.collective_rows([rec("all_reduce", "zerompi", 64 << 20, 30.0),
                                       rec("all_reduce", "mpi", 64 << 20, 20.0),
                                       rec("all_to_all", "zerompi-sp", (1 << 20) + 512, 4.0),
                                       rec("all_to_all", "mpi", (1 << 20) + 512, 2.0)])
    assert [(r["name"], r["ratio"]) for r in rows] == [("all_reduce_64mib_vs_mpi", 1.5),
                                                        ("all_to_all_1mib_vs_mpi", 2.0)]
    assert checks[0]["ok"]

    rows, _ = sr.adam_rows([{"backend": "cpu", "n": 1, "fused_s": 9.0, "copy_s": 1.0},
                            {"backend": "cpu", "n": 4, "fused_s": 3.0, "copy_s": 2.0}])
    assert rows[0]["ratio"] == 1.5 and rows[0]["params"] == 4 and rows[0]["met"] is True   # the largest size

    lines = [{"N": 2, "stage": s, "dtype": "fp16", "median_step_s": t} for s, t in ((2, 0.2), (3, 0.25))]
    rows, checks = sr.stages_rows(lines + [{"check": "parity", "ok": False},
                                           {"bar": "x", "N": 2, "dtype": "fp16", "ratio": 1.25}])
    assert rows[0]["name"] == "stage3_vs_stage2" and rows[0]["ratio"] == pytest.approx(1.25) and not rows[0]["met"]
    assert checks[0]["ok"] is False

    mode = lambda t, b=0.1, h="a": {"step_s": t, "backward_s": b, "sha256": h}  # noqa: E731
    case = lambda io, h: {"case": "c", "stage": 2, "io_alone_s": {"direct": io},  # noqa: E731
                          "modes": {"none": mode(1.0), "cpu": mode(1.04), "nvme": mode(2.4)},
                          "goals": {"io_alone_vs_backward": io / 0.1, "bit_identical": h}}
    rows, checks = sr.offload_rows({"cases": [case(2.0, True)]})
    assert [(r["name"], r["ratio"], r["met"]) for r in rows] == [("offload_cpu_vs_memory", 1.04, True),
                                                                   ("nvme_vs_io", 1.2, False),
                                                                   ("nvme_vs_memory", 2.4, None)]
    assert checks[0]["ok"] and "longer" in rows[2]["note"]
    rows, checks = sr.offload_rows({"cases": [case(0.05, False)]})   # the I/O shorter than the backward
    named = [(r["name"], round(r["ratio"], 9), r["met"]) for r in rows[1:]]
    assert named == [("nvme_vs_io", 48.0, None), ("nvme_vs_memory", 2.4, False)]
    assert checks[0]["ok"] is False and "shorter" in rows[1]["note"]

    rows, _ = sr.checkpoint_rows({"params": 1, "async": {"median_stall_s": 0.05}, "sync": {"median_stall_s": 1.0},
                                  "ceiling": {"median_s": 0.8}})
    assert [(r["name"], r["ratio"], r["met"]) for r in rows] == [("checkpoint_async_stall", 0.05, True),
                                                                   ("checkpoint_sync_vs_disk", 1.25, True)]

    rows, _ = sr.pipeline_rows({"rows": [{"mesh": "pp 2", "schedule": "zb-h1", "m": 8, "step_time_s": 0.1,
                                          "bubble_measured": 0.145, "bubble_replayed": 0.1,
                                          "bubble_simulated": 0.08}]}, "bubble_zbh1")
    assert rows[0]["ratio"] == pytest.approx(1.45) and rows[0]["met"] is False and rows[0]["unit"] == "fraction"
    assert rows[0]["simulated_median_costs"] == 0.08 and rows[0]["over_median_costs"] == pytest.approx(0.145 / 0.08)

    run = lambda name, t, e: {"name": name, "step_s": t, "estimate_step_s": e, "link": "250mbit"}  # noqa: E731
    rows, _ = sr.cluster_rows([run("flat3", 2.0, 2.6), run("zeropp", 0.6, 0.5)])
    assert [(r["name"], round(r["ratio"], 6), r["met"]) for r in rows] == [
        ("zeropp_4x1", 0.3, True), ("estimate_error_flat3_4x1", 0.3, False), ("estimate_error_zeropp_4x1",
                                                                              round(0.1 / 0.6, 6), True)]


def test_the_doc_has_every_row_the_machine_the_date_and_a_plot(tmp_path):
    rows = [sr.row("gpt_vs_gemm", 0.6, 0.5, 1.15), sr.row("check_1mib_all_gather", 51.0, 50.0, 1.02, "µs"),
            sr.row("tp_step_vs_dp_step_n2", 0.4, 0.2), sr.skipped("zeropp_4x1", "no namespaces here", 0.35),
            dict(sr.row("nvme_vs_memory", 2.0, 1.0, 1.15), met=None, note="the bound is nvme_vs_io's")]
    result = {"mode": "quick", "date": "2026-01-02T03:04:05+00:00", "seconds": 12.0, "load_average_1min": [1.5, 2.5],
              "rows": rows, "checks": [sr.check("stages_bit_identical", True, "parity")], "errors": {},
              "machine": {"cpu": "Some CPU 3000", "cores": 2, "mpi": "MPICH Version: 9", "numpy": "1.0",
                          "python": "3.x", "system": "Linux"}}
    suite_doc.write(result, tmp_path / "performance.md", "Measured under load.")
    md = (tmp_path / "performance.md").read_text()
    assert (tmp_path / "performance.png").read_bytes()[:4] == b"\x89PNG" and "](performance.png)" in md
    for text in ("| `gpt_vs_gemm` | 600 ms | 500 ms | 1.200 | ≤ 1.15 | **missed** |",
                 "| `check_1mib_all_gather` | 51 µs | 50 µs | 1.020 | ≤ 1.02 | met |",
                 "| `tp_step_vs_dp_step_n2` | 400 ms | 200 ms | 2.000 | — | — |",
                 "| `zeropp_4x1` | — | — | — | ≤ 0.35 | skipped: no namespaces here |",
                 "| `nvme_vs_memory` | 2 s | 1 s | 2.000 | ≤ 1.15 | — (the bound is nvme_vs_io's) |",
                 "Some CPU 3000, 2 cores", "MPICH Version: 9", "NumPy 1.0", "2026-01-02T03:04:05+00:00",
                 "Measured under load.", "1 of 2 rows with a goal meet it", "`stages_bit_identical`: holds"):
        assert text in md, text
    why = md.split("## The goals missed in this run, and why")[1].split("Bit checks")[0]
    assert "- `gpt_vs_gemm` (1.200 against ≤ 1.15): The step's own matrix multiplies run at the floor" in why, why
    assert "check_1mib_all_gather" not in why and "nvme_vs_memory" not in why and "zeropp_4x1" not in why, why
    for r in rows:                    # every row met (or without a goal): the section says so
        r["met"] = None if r["met"] is None else True
    suite_doc.write(result, tmp_path / "performance.md")
    assert "- none: every row with a goal meets it in this run" in (tmp_path / "performance.md").read_text()


def test_every_debt_that_can_miss_is_explained():
    """Each debt of the issue (the rows with a goal that this machine has missed) has its why, not the fallback."""
    for name in ("gpt_vs_gemm", "check_1mib_all_gather", "check_1mib_reduce_scatter", "nvme_vs_io", "zeropp_4x1"):
        assert suite_doc.why_missed(name) != "not explained yet.", name
    assert suite_doc.why_missed("bubble_zbh1") == "not explained yet."


def test_one_path_end_to_end(tmp_path):
    out = tmp_path / "suite.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_suite.py"), "--quick", "--only", "adam",
                           "--json", str(out), "--doc", str(tmp_path / "perf.md")],
                          capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert FIELDS <= set(row) and row["name"] == "adamw_vs_copy" and row["goal"] == 2.0 and row["unit"] == "s"
    assert math.isfinite(row["ratio"]) and row["ratio"] > 0 and row["ratio"] == row["measured"] / row["floor"]
    assert result["errors"] == {} and set(result["machine"]) >= {"cpu", "cores", "mpi", "numpy"}
    assert "| `adamw_vs_copy` |" in (tmp_path / "perf.md").read_text() and (tmp_path / "perf.png").exists()
    assert str(ROOT) not in json.dumps(result["commands"])      # no path of the machine in what it writes


def test_torch_python_that_is_no_program_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_suite.py"), "--only", "torch_dist",
                           "--torch-python", "no-such-python-here"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--torch-python no-such-python-here: no such program" in proc.stderr


def test_unknown_path_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_suite.py"), "--only", "adam,nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown paths ['nope']" in proc.stderr


def test_every_debt_has_its_row():
    """The rows the issue names come from the paths' parsers (or the skipped rows of a missing path)."""
    names = {r for p in bench_suite.PATHS for r in p["skip_rows"]}
    names |= {"gpt_vs_gemm", "nvme_vs_io", "bubble_1f1b_pp2_dp2", "bubble_zbh1"}
    names |= {f"check_1mib_{op}" for op in ("all_gather", "reduce_scatter")}
    assert set(DEBTS) <= names
    calls = {p["name"]: p["argv"]("check", ROOT) for p in bench_suite.PATHS}
    assert "--ms" in calls["pipeline_1f1b"] and "dp" in calls["pipeline_1f1b"]


@pytest.mark.slow
def test_check_mode_every_path_runs_and_its_bits_hold(tmp_path):
    """The correctness half of --quick (CI runs it; never its timings): every path at its smallest size."""
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_suite.py"), "--check", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and result["errors"] == {}, proc.stdout + proc.stderr
    assert all(c["ok"] for c in result["checks"]), result["checks"]
    names = {r["name"] for r in result["rows"]}
    assert set(DEBTS) <= names, set(DEBTS) - names
    held = {c["name"].split(" ")[0] for c in result["checks"]}
    assert {"stages_bit_identical", "offload_bit_identical", "gpt_stages_bit_identical", "collectives_oracle"} <= held


def test_a_failing_path_is_an_error_not_a_row():
    """A command that exits badly, or whose output cannot be read, is the path's error (the suite exits 1)."""
    bad = bench_suite.path("bad", lambda mode, tmp: [sys.executable, "-c", "import sys; sys.exit(3)"],
                           lambda outs, tmp: ([], []))
    r = bench_suite.run_path(bad, "check", 60)
    assert r["error"].startswith("exit 3: python -c") and r["rows"] == []
    garbled = bench_suite.path("garbled", lambda mode, tmp: [sys.executable, "-c", "print('no json')"],
                               lambda outs, tmp: sr.signature_rows(bench_suite.document(outs[0])))
    r = bench_suite.run_path(garbled, "check", 60)
    assert "could not be read" in r["error"] and r["rows"] == []


def test_bench_pipeline_asks_for_one_row():
    """The options the suite added to bench_pipeline.py pick one mesh, schedule and m; without them, every row."""
    from types import SimpleNamespace
    import bench_pipeline as bp
    base = dict(ranks=4, n_layer=8, d_model=128, seq_len=64, steps=10, bucket_mb=0.25, batch_per_mb=4,
                meshes=list(bp.MESH_KEYS), schedules=None, ms=None, stage_rows=True)
    assert len(bp.configs(SimpleNamespace(**base, quick=False))) == 3 * 4 * 2 + 3
    assert len(bp.configs(SimpleNamespace(**base, quick=True))) == 3 * 2 * 1 + 3
    one = bp.configs(SimpleNamespace(**dict(base, meshes=["dp"], schedules=["1f1b"], ms=[8], stage_rows=False),
                                     quick=False))
    assert [(r["mesh"], r["schedule"], r["m"], r["stage"]) for r in one] == [("pp 2 x dp 2", "1f1b", 8, 1)]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--meshes", "dp,xx"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown meshes or schedules ['xx']" in proc.stderr


def test_torch_dist_rows_from_each_rounds_steps(tmp_path):
    """zerompi's train CLI metrics and PyTorch's step lines of two rounds become the two rows (hand values)."""
    outs = []
    z = {"gpt_n2_vs_torch_ddp": ([9, 9, 2.0, 4.0], [9, 9, 3.0, 3.0]),
         "gpt_n4_vs_torch_fsdp2": ([9, 9, 6.0], [9, 9, 8.0])}
    t = {"gpt_n2_vs_torch_ddp": ([9, 9, 1.0, 1.0], [9, 9, 2.0, 2.0]),
         "gpt_n4_vs_torch_fsdp2": ([9, 9, 4.0], [9, 9, 2.0])}
    for r in range(2):
        for name, *_ in bench_suite.TORCH_DIST:
            (tmp_path / f"{name}-{r}.json").write_text(json.dumps({"step_times_s": z[name][r]}))
            outs += ["", "a log line\n" + json.dumps({"mode": "x", "step_s": t[name][r]})]
    rows, checks = bench_suite.torch_dist_parse(outs, tmp_path)
    by = {r["name"]: r for r in rows}
    assert set(by) == {"gpt_n2_vs_torch_ddp", "gpt_n4_vs_torch_fsdp2"} and checks == []
    ddp, fsdp = by["gpt_n2_vs_torch_ddp"], by["gpt_n4_vs_torch_fsdp2"]
    assert (ddp["measured"], ddp["floor"], ddp["ratio"]) == (3.0, 1.5, 2.0) and ddp["paired_ratio"] == 2.25
    assert (fsdp["measured"], fsdp["floor"], fsdp["ratio"]) == (7.0, 3.0, 7.0 / 3.0) and fsdp["paired_ratio"] == 2.75
    assert (ddp["N"], ddp["zerompi_stage"], ddp["torch"], fsdp["N"], fsdp["zerompi_stage"], fsdp["torch"]) == (
        2, 0, "ddp", 4, 3, "fsdp2") and ddp["goal"] is None and ddp["dtype"] == "fp32"


def test_torch_dist_commands_same_shapes_fp32_interleaved(tmp_path):
    argvs = bench_suite.torch_dist_argv("quick", tmp_path)
    assert len(argvs) == 2 * 2 * len(bench_suite.TORCH_DIST)          # two rounds, each row's pair in turn
    zerompi, torch = argvs[0], argvs[1]
    assert "zerompi.train" in zerompi and zerompi[zerompi.index("--dtype") + 1] == "fp32"
    assert zerompi[zerompi.index("--stage") + 1] == "0" and torch[torch.index("--mode") + 1] == "ddp"
    for k in ("--n-layer", "--d-model", "--n-head", "--seq-len", "--batch"):
        assert zerompi[zerompi.index(k) + 1] == torch[torch.index(k) + 1], k
    assert torch[torch.index("--model") + 1] == "builtin" and argvs[3][argvs[3].index("--mode") + 1] == "fsdp2"


def test_torch_dist_rows_skipped_with_a_line_without_torch(tmp_path, monkeypatch):
    """--quick without PyTorch: both rows in the table, each skipped with why (an interpreter without torch)."""
    no_torch = tmp_path / "python"
    no_torch.write_text("#!/bin/sh\nexit 1\n")
    no_torch.chmod(0o755)
    monkeypatch.setattr(bench_suite, "TORCH_PYTHON", str(no_torch))
    result = bench_suite.run_suite(["torch_dist"], "quick", 60)
    assert [(r["name"], r["ratio"]) for r in result["rows"]] == [("gpt_n2_vs_torch_ddp", None),
                                                                  ("gpt_n4_vs_torch_fsdp2", None)]
    assert all("cannot import torch" in r["skipped"] for r in result["rows"]) and result["errors"] == {}
    md = suite_doc.table(result["rows"])
    assert "| `gpt_n2_vs_torch_ddp` | — | — | — | — | skipped: --torch-python" in md


def test_the_n1_torch_row_runs_where_torch_and_zerompi_import_together(tmp_path, monkeypatch):
    """Without torch in zerompi's interpreter the N = 1 row (both timed in one process) runs under
    --torch-python, and is skipped with why where zerompi does not import there."""
    import importlib.util
    if importlib.util.find_spec("torch"):
        pytest.skip("torch is in zerompi's own interpreter: the row runs there")
    no_torch = tmp_path / "python"
    no_torch.write_text("#!/bin/sh\necho 'ModuleNotFoundError: torch' >&2\nexit 1\n")
    no_torch.chmod(0o755)
    monkeypatch.setattr(bench_suite, "TORCH_PYTHON", str(no_torch))
    assert bench_suite.torch_argv("check", tmp_path)[0] == str(no_torch)
    why = bench_suite.torch_missing()
    assert why.startswith("--torch-python's interpreter cannot import zerompi beside torch (ModuleNotFoundError")
    monkeypatch.setattr(bench_suite, "TORCH_PYTHON", None)
    assert bench_suite.torch_argv("check", tmp_path)[0] == sys.executable
    assert bench_suite.torch_missing() == "PyTorch is not installed (pip install torch)"


@pytest.mark.slow
def test_torch_dist_rows_measured_where_torch_is(tmp_path):
    """Where an interpreter has torch (ZEROMPI_TORCH_PYTHON, else this one): --check measures both rows (finite
    ratios; never a timing asserted)."""
    import os
    py = os.environ.get("ZEROMPI_TORCH_PYTHON", sys.executable)
    if subprocess.run([py, "-c", "import torch.distributed"], capture_output=True).returncode:
        pytest.skip("no interpreter with torch (set ZEROMPI_TORCH_PYTHON)")
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_suite.py"), "--check", "--only",
                           "torch_dist", "--torch-python", py, "--json", str(out)],
                          capture_output=True, text=True, timeout=1500, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"gpt_n2_vs_torch_ddp", "gpt_n4_vs_torch_fsdp2"}
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in rows.values())


def test_the_checks_floor_in_c_runs_and_reports_each_size():
    """scripts/bench_check_floor.py builds its C program with this MPI's mpicc and times the three forms;
    a size that is not one gets one line (exit 2)."""
    import launch
    if launch.mpicc() is None:
        pytest.skip("no mpicc here")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_check_floor.py"), "--sizes", "4K,1000",
                           "--rounds", "1", "--seconds", "0.001"], capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    records = bench_suite.document(proc.stdout)["records"]
    assert [(r["bytes"], r["ranks"], r["header_bytes"]) for r in records] == [(4096, 2, 64), (1000, 2, 64)]
    assert all(r[f"{f}_us"] > 0 for r in records for f in ("mpi", "checked", "data_only"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_check_floor.py"), "--sizes", "1X"],
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert proc.returncode == 2 and "--sizes '1X'" in proc.stderr.splitlines()[-1], proc.stderr
