"""One line, exit status 2, for the rough edges issue 29 found: a bad ZEROMPI_NODE_SIZE, shard groups
that do not fit MPI's nodes, the user's own values in the message under --tp, flags that were accepted
and ignored, ZeroConfig's types (one rule for every field) and unknown fields, Communicator(None).

The CLI cases that need the ranks to meet run under mpiexec (the one line is the start-up
agreement's); the others run the same checks in this process (parse_config and check_world are what
every rank runs before the agreement)."""
import json

import numpy as np
import pytest

from tests.mpirun import one_line, run_mpi
from zerompi import MeshConfig, ZeroConfig
from zerompi.errors import ConfigError
from zerompi.estimate import cli as estimate_cli
from zerompi.train.config import parse_config

LIMIT = 60
MLP = ["--model", "mlp", "--width", "16", "--depth", "2", "--batch", "8", "--steps", "2"]


@pytest.mark.parametrize("value,needle", [("abc", "ZEROMPI_NODE_SIZE='abc' is not allowed"),
                                          ("3", "ZEROMPI_NODE_SIZE=3 sets the node size, and node_size=3 does not "
                                                "divide the 2 ranks")])
def test_a_bad_node_size_variable_is_one_line_naming_it(value, needle):
    proc = run_mpi(2, ["-m", "zerompi.train", *MLP], timeout=LIMIT, check=False, env={"ZEROMPI_NODE_SIZE": value})
    one_line(proc, 2, "zerompi.train: error: " + needle)


def test_node_size_zero_and_flags_that_do_not_fit_one_rank(monkeypatch):
    monkeypatch.setenv("ZEROMPI_NODE_SIZE", "0")
    with pytest.raises(ConfigError, match=r"^ZEROMPI_NODE_SIZE='0' is not allowed; use a whole number"):
        parse_config(MLP).check_world(2)
    monkeypatch.delenv("ZEROMPI_NODE_SIZE")
    with pytest.raises(ConfigError, match=r"^node_size=3 does not divide the 1 ranks"):
        parse_config(MLP + ["--node-size", "3"]).check_world(1)       # was accepted and ignored


@pytest.mark.parametrize("flags", [["--shard-size", "2"], ["--tp", "2", "--shard-size", "2"]])
def test_shard_groups_that_do_not_fit_the_nodes_are_one_line_with_the_users_values(flags):
    """4 ranks on one machine are one node of 4 (MPI's shared-memory split): shard groups of 2 are not
    whole nodes. It was a line and an abort banner per rank, and under --tp 2 named shard_size=1."""
    proc = run_mpi(4, ["-m", "zerompi.train", *MLP, *flags], timeout=LIMIT, check=False)
    line = one_line(proc, 2, "zerompi.train: error: shard_size=2 is not allowed with 4 ranks in nodes of 4",
                    "MPI's shared-memory split")
    assert "shard_size=1" not in line


@pytest.mark.parametrize("flags,needle", [
    (["--offload-dir", "."], "offload_dir='.' (--offload-dir) applies with --offload-optimizer nvme or "
                             "--offload-params nvme"),
    (["--dtype", "bf16", "--max-skipped-steps", "3"], "max_skipped_steps=3 (--max-skipped-steps) applies with "
                                                      "--dtype fp16"),
])
def test_flags_that_were_accepted_and_ignored_are_refused(flags, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_config(MLP + flags)


def test_estimate_refuses_a_size_beside_from_run(tmp_path, capsys):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({}))
    for flags, needle in ((["--params", "1e9"], "params=1000000000.0 (--params) does not apply with --from-run"),
                          (["--ranks", "8"], "ranks=8 (--ranks) does not apply with --from-run")):
        assert estimate_cli.main(["--from-run", str(run), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("zerompi.estimate: error: " + needle) and err.count("\n") == 1, err


@pytest.mark.parametrize("kwargs,needle", [
    ({"stage": True}, "stage=True is a bool; give a whole number"), ({"stage": 3.0}, "stage=3.0 is a float"),
    ({"micro_batches": True}, "micro_batches=True is a bool"),
    ({"prefetch": np.float64(1)}, r"prefetch=np.float64\(1.0\) is a float; give a whole number \(an int: 1\)"),
    ({"lr": True}, "lr=True is a bool; give a number"), ({"overlap": 1}, "overlap=1 must be True or False"),
])
def test_zero_config_refuses_a_bool_for_a_number_and_a_float_for_an_int(kwargs, needle):
    with pytest.raises(ConfigError, match="^" + needle):
        ZeroConfig(**kwargs)


def test_zero_config_takes_numpy_scalars_as_pythons():
    cfg = ZeroConfig(stage=np.int64(3), lr=np.float32(1e-3), micro_batches=np.int64(2), bucket_mb=np.float64(2.5),
                     overlap=np.bool_(False), timeout_s=np.float32(5))
    assert (cfg.stage, cfg.micro_batches, MeshConfig(node_size=np.int32(1)).node_size) == (3, 2, 1)
    assert cfg.overlap is False
    assert cfg.lr == float(np.float32(1e-3)) and cfg.bucket_mb == 2.5 and cfg.timeout_s == 5.0
    kinds = {k: type(v) for k, v in cfg.to_dict().items() if k in ("stage", "lr", "micro_batches", "overlap")}
    assert kinds == {"stage": int, "lr": float, "micro_batches": int, "overlap": bool}
    json.dumps(cfg.to_dict())                     # the manifest's config, the consistency digest


def test_an_unknown_zero_config_field_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"^ZeroConfig has no field 'stgae' \(did you mean 'stage'\?\); the fields"
                                          r" are stage, dtype") as e:
        ZeroConfig(stgae=3)
    assert isinstance(e.value, TypeError)         # as Python's own was: callers catching TypeError still do


def test_communicator_of_none_is_refused():
    from zerompi import Communicator
    with pytest.raises(ConfigError, match=r"^Communicator\(mpi_comm=None\): not an mpi4py communicator"):
        Communicator(None)
    assert Communicator().size >= 1               # no argument: MPI.COMM_WORLD
