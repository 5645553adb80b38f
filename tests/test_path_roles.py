"""Nothing lost to a path given twice (issue 29): every tool resolves all of its paths at start and
refuses, in one line naming both roles, an output that is an input, another output, the stop file,
or lies inside a save or offload folder it uses (outputs.check_roles), before it writes anything.

The train CLI's cases run its start-up checks in this process (parse_config, then preflight.check_outputs,
what main() runs on every rank before the agreement); one job under mpiexec checks the wiring and that the
input survives. The one-process tools run as they are."""
import os
import subprocess
import sys

import pytest

from tests.mpirun import ROOT, one_line, run_mpi
from zerompi.errors import ConfigError
from zerompi.train.config import parse_config
from zerompi.train.preflight import check_outputs

LIMIT = 60
MLP = ["--model", "mlp", "--width", "16", "--depth", "2", "--batch", "4", "--steps", "2"]


def tool(module, *args):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=LIMIT, cwd=str(ROOT))


@pytest.fixture
def place(tmp_path, monkeypatch):
    """tmp_path as the working folder, with a data file, a hard link to it, and a save folder holding
    one (fake) checkpoint and its ``latest``: nothing here is read, only the paths are compared."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.bin").write_bytes(bytes(range(256)) * 4)
    os.link(tmp_path / "d.bin", tmp_path / "hard.bin")
    (tmp_path / "ck" / "step_000002").mkdir(parents=True)
    (tmp_path / "ck" / "step_000002" / "manifest.json").write_text("{}")
    (tmp_path / "ck" / "latest").write_text("step_000002\n")
    (tmp_path / "link").symlink_to(tmp_path / "ck")
    return tmp_path


@pytest.mark.parametrize("flags,needle", [
    (["--data", "d.bin", "--metrics-json", "d.bin"], "metrics_json='d.bin' is also the input data='d.bin'"),
    (["--data", "d.bin", "--trace", "hard.bin"], "trace='hard.bin' is also the input data='d.bin'"),   # a hard link
    (["--trace", "m.json", "--metrics-json", "./m.json"], "metrics_json='./m.json' and trace='m.json' are the same"),
    (["--trace", "ck/latest", "--save-dir", "ck", "--resume", "ck"], "trace='ck/latest' lies inside the input resume"),
    (["--trace", "link/latest", "--save-dir", "ck", "--overwrite"], "trace='link/latest' lies inside save_dir='ck'"),
    (["--metrics-json", "ck/step_000002/manifest.json", "--save-dir", "ck", "--overwrite"],
     "metrics_json='ck/step_000002/manifest.json' lies inside save_dir='ck'"),
    (["--metrics-json", "ck/latest", "--resume", "ck/step_000002"], "lies inside the input resume's save folder"),
    (["--metrics-json", "new", "--save-dir", "new"], "metrics_json='new' is the folder save_dir='new' itself"),
    (["--trace", "s", "--stop-file", "s"], "trace='s' and stop_file='s' are the same file: the run would stop"),
    (["--stop-file", "new/latest", "--save-dir", "new"], "stop_file='new/latest' lies inside save_dir='new'"),
    (["--save-dir", "x", "--offload-dir", "x/", "--offload-optimizer", "nvme"], "save_dir='x' and offload_dir='x/' "
                                                                                 "are one folder"),
    (["--metrics-json", "off/m.json", "--offload-dir", "off", "--offload-optimizer", "nvme"],
     "metrics_json='off/m.json' lies inside offload_dir='off'"),
    (["--pp", "2", "--schedule-file", "d.bin", "--metrics-json", "d.bin"],
     "metrics_json='d.bin' is also the input schedule_file='d.bin'"),
    (["--pp", "2", "--schedule-file", "d.bin", "--trace", "./d.bin"], "trace='./d.bin' is also the input "
                                                                        "schedule_file='d.bin'"),
])
def test_train_refuses_a_path_in_two_roles(place, flags, needle):
    gpt = "--data" in flags
    cfg = parse_config((["--model", "gpt", "--seq-len", "8"] if gpt else MLP) + flags)
    with pytest.raises(ConfigError) as e:
        check_outputs(cfg, 0)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_trace_a_rank_writes_when_it_aborts_is_an_output_too(place):
    cfg = parse_config(MLP + ["--trace", "t.json", "--metrics-json", "t.rank1.json"])
    check_outputs(cfg, 0)                         # rank 0 writes t.json itself
    with pytest.raises(ConfigError, match="metrics_json='t.rank1.json' and the trace of rank 1 if it aborts"):
        check_outputs(cfg, 1)


def test_a_path_of_its_own_passes(place):
    cfg = parse_config(MLP + ["--trace", "t.json", "--metrics-json", "m.json", "--save-dir", "ck", "--resume",
                              "ck/step_000002", "--stop-file", "STOP"])
    check_outputs(cfg, 1)                         # resuming into its own save folder is what --save-dir is for


def test_train_leaves_its_data_file_alone(place):
    data = place / "d.bin"
    before = data.read_bytes()
    proc = run_mpi(2, ["-m", "zerompi.train", "--model", "gpt", "--seq-len", "8", "--n-layer", "1", "--steps", "1",
                       "--data", data, "--metrics-json", data], timeout=LIMIT, check=False)
    one_line(proc, 2, "zerompi.train: error: metrics_json=", "is also the input data=")
    assert data.read_bytes() == before and sorted(p.name for p in place.iterdir()) == [
        "ck", "d.bin", "hard.bin", "link"]


def test_the_offline_tools_refuse_an_output_over_what_they_read(place):
    latest = (place / "ck" / "latest").read_text()
    for where in ("ck", "ck/step_000002"):        # a save folder, or one checkpoint of it
        proc = tool("zerompi.checkpoint", "consolidate", where, "ck/latest")
        one_line(proc, 2, "zerompi.checkpoint: error: out='ck/latest' lies inside the input dir")
    assert (place / "ck" / "latest").read_text() == latest
    run = place / "m.json"
    run.write_text('{"not": "touched"}')
    proc = tool("zerompi.estimate", "--from-run", run, "--json", run)
    one_line(proc, 2, "zerompi.estimate: error: json=", "is also the input from_run=")
    assert run.read_text() == '{"not": "touched"}' and proc.stdout == ""
