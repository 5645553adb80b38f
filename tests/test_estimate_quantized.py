"""zerompi.estimate with quantized communication (--quantize-weights, --quantize-grads, --quant-block):
the wire bytes per step equal what the engine measures (stages 2 and 3, one and two simulated
nodes), the logical bytes equal the unquantized estimate, the time is on the wire, bad settings
are one line and exit 2, and it runs without MPI."""
import json

import pytest

import zerompi
from zerompi.estimate import cli as estimate_cli, fromrun

from .mpirun import run_mpi
from .test_architecture import python as python_without_mpi
from .test_estimate_topology import BUCKET_MB, DEPTH, NET, TRAIN, WIDTH, mlp_layout

N = 4
RUNS = [   # --no-overlap: each step's bytes are its own, at both levels
    "--stage 2 --dtype fp32 --quantize-grads int4",
    "--stage 3 --dtype fp16 --quantize-weights int8 --quantize-grads int8",
    "--stage 2 --dtype fp16 --node-size 2 --quantize-weights int8 --quantize-grads int4",
    "--stage 3 --dtype fp32 --node-size 2 --quantize-weights int8 --quantize-grads int4 --quant-block 16",
    "--stage 3 --dtype fp32 --node-size 2 --hpz --quantize-weights int8 --micro-batches 2",
]
LEVELS = ("intra", "inter")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quantized_runs")
    run_mpi(N, ["-c", TRAIN, tmp, ";".join(RUNS), "--model", "mlp", "--width", WIDTH, "--depth", DEPTH,
                "--bucket-mb", BUCKET_MB, "--steps", 3, "--batch", 4 * N, "--no-overlap"], timeout=300)
    return [(flags, tmp / f"r{i}.json", json.loads((tmp / f"r{i}.json").read_text())) for i, flags in enumerate(RUNS)]


def test_estimate_equals_the_engines_measured_wire_bytes(runs):
    for flags, _, m in runs:
        q, topo, zero = m["quantization"], m["topology"], m["config"]["zero"]
        assert not zero["overlap"] and (q["weights"] or q["grads"])
        quant = dict(quantize_weights=q["weights"], quantize_grads=q["grads"], quant_block=q["block"])
        kw = dict(ranks=N, dtype=m["dtype"], bucket_mb=BUCKET_MB, micro_batches=zero["micro_batches"],
                  prefetch=zero["prefetch"], overlap=False, node_size=topo["node_size"], hpz=topo["hpz"], **NET)
        layout = mlp_layout(N, 1, m["dtype"])
        assert layout.numel == m["padded_params"]
        stage = m["stage"]
        by_layout = zerompi.estimate(layout=layout, **kw, **quant)["stages"][stage]
        by_shape = zerompi.estimate(params=m["params"], layers=DEPTH, **kw, **quant)["stages"][stage]
        plain = zerompi.estimate(layout=layout, **kw)["stages"][stage]
        wire, logical = m["comm_bytes_per_step_by_level"], m["comm_logical_bytes_per_step"]
        # the wire bytes per level: the estimate equals what the engine sent (a steady step, max over ranks)
        for row in (by_layout, by_shape):
            assert row["comm_bytes_per_step_by_level"] == wire, (flags, row["comm_bytes_per_step_by_level"], wire)
        assert sum(wire.values()) == m["comm_bytes_per_step"]
        assert sum(wire.values()) < logical                                  # it did quantize
        # the logical bytes: the unquantized estimate's, and what the engine counted as logical
        assert by_layout["comm_logical_bytes_per_step_by_level"] == plain["comm_bytes_per_step_by_level"]
        assert by_layout["comm_logical_bytes_per_step"] == plain["comm_bytes_per_step"]
        assert sum(plain["comm_bytes_per_step_by_level"].values()) == logical, flags
        if topo["node_size"] == N:   # one node: the ring volumes are the engine's total (stage 3: less the turns)
            assert by_layout["comm_bytes_per_step"] - by_layout["comm_bytes_kept_at_turns"] == m["comm_bytes_per_step"]
        # --from-run reads the run's quantization and puts the measured bytes beside the estimate
        cmp = fromrun.compare_run(fromrun.run_estimate(m), m)
        for key in ("comm_intra_bytes_per_step", "comm_inter_bytes_per_step", "comm_logical_bytes_per_step"):
            assert cmp["measured"][key] == cmp["estimate"][key], (flags, key, cmp)


def test_from_run_prints_wire_and_logical(runs, capsys):
    flags, path, m = runs[3]
    assert estimate_cli.main(["--from-run", str(path)]) == 0
    text = capsys.readouterr().out
    rows = {line[:32].strip(): line[32:].split() for line in text.splitlines() if line.startswith("  ")}
    assert "unquantized inside, kB" in rows and "unquantized across, kB" in rows, text
    assert "quantized: weights int8 (qwZ" in text and "gradients int4 (qgZ" in text and "blocks of 16" in text
    # stage 3's comm_bytes_per_step is the 3 passes' ring volume (the engine keeps buckets at the turns);
    # the rows per level and the logical bytes are the engine's formula, to the byte
    measured = [line.split() for line in text.splitlines() if line.strip().startswith("comm_")]
    exact = [cells for cells in measured if cells[0] != "comm_bytes_per_step"]
    assert len(exact) == 3 and all(cells[1] == cells[2] and cells[3] == "0" for cells in exact), measured


def wire(bits: int, k: int, block: int = 64) -> int:
    values = k if bits == 8 else (k + 1) // 2
    return (values + 3) // 4 * 4 + 4 * -(-k // block)


def test_bytes_and_time_by_hand():
    """One bucket of 4096 fp32 elements on 4 ranks: slices of 1024; int4 gradients travel 512 + 16 x 4
    bytes a slice, int8 weights 1024 + 16 x 4; time = calls x 3 x latency + wire bytes at the bandwidth."""
    kw = dict(params=4096, ranks=4, dtype="fp32", bucket_mb=1, latency_us=5.0, bandwidth_gbps=100.0)
    q = zerompi.estimate(**kw, quantize_weights="int8", quantize_grads="int4")
    plain = zerompi.estimate(**kw)
    assert q["buckets"] == 1 and q["padded_params"] == 4096
    rs, ag, ag_plain = 3 * wire(4, 1024), 3 * wire(8, 1024), 3 * 1024 * 4
    assert (rs, ag) == (3 * 576, 3 * 1088)
    want = {0: rs + ag_plain, 1: rs + ag, 2: rs + ag, 3: rs + 2 * ag}
    for s, row in enumerate(q["stages"]):
        assert row["comm_bytes_per_step"] == want[s], s
        assert row["comm_logical_bytes_per_step"] == plain["stages"][s]["comm_bytes_per_step"]
        calls = 3 if s == 3 else 2
        assert row["comm_seconds_per_step"] == pytest.approx(calls * 3 * 5e-6 + want[s] * 8 / 100e9)
        lv = row["comm_bytes_per_step_by_level"]
        assert lv["inter"] == 0 and lv["intra"] == want[s] - row["comm_bytes_kept_at_turns"]
        assert row["comm_seconds_per_step_by_level"]["intra"] == \
            pytest.approx(row["comm_messages_per_step_by_level"]["intra"] * 5e-6 + lv["intra"] * 8 / 100e9)
    assert q["stages"][3]["comm_bytes_kept_at_turns"] == ag              # the one bucket, kept at the turn
    assert q["quantization"] == {"weights": "int8", "grads": "int4", "block": 64} and q["quantized"]
    assert not plain["quantized"]


def test_two_levels_by_hand():
    """8 ranks in 2 nodes of 4, one bucket of 8192 fp16 elements (slices of 1024), int8 gradients: the
    node level sends a super-slice (2 slices) to each of 3 peers, across nodes a slice to 1 peer."""
    est = zerompi.estimate(params=8192, ranks=8, dtype="fp16", node_size=4, quantize_grads="int8",
                           intra_gbps=200.0, inter_gbps=25.0)
    lv = est["stages"][2]["comm_bytes_per_step_by_level"]
    gather = (3 * 2 * 1024 * 2, 1 * 1024 * 2)                             # unquantized publish
    assert lv == {"intra": 3 * wire(8, 2048) + gather[0], "inter": 1 * wire(8, 1024) + gather[1]}
    flat = est["stages"][2]["comm_bytes_per_step_if_flat"]               # flat over 8: 3 peers inside, 4 across
    assert flat == {"intra": 3 * wire(8, 1024) + 3 * 2048, "inter": 4 * wire(8, 1024) + 4 * 2048}


def test_cli_rows_and_json(capsys, tmp_path):
    out = tmp_path / "e.json"
    argv = ["--params", "10e9", "--ranks", "64", "--quantize-weights", "int8", "--quantize-grads", "int4",
            "--json", str(out)]
    assert estimate_cli.main(argv) == 0
    text = capsys.readouterr().out
    rows = {line[:32].strip(): line[32:].split() for line in text.splitlines() if line.startswith("  ")}
    plain = zerompi.estimate(params=10e9, ranks=64)["stages"]
    assert rows["unquantized (logical), GB"] == [f"{r['comm_bytes_per_step'] / 1e9:.4f}" for r in plain]
    data = json.loads(out.read_text())
    assert data["stages"] == zerompi.estimate(params=10e9, ranks=64, quantize_weights="int8",
                                              quantize_grads="int4")["stages"]
    # ZeRO++'s claim for stage 3: int8 gathers and int4 reduce-scatters move under half of 3 passes
    assert data["stages"][3]["comm_bytes_per_step"] < 0.5 * plain[3]["comm_bytes_per_step"]
    assert estimate_cli.main(["--params", "10e9", "--ranks", "64"]) == 0
    assert "unquantized" not in capsys.readouterr().out                  # the default table is as before


@pytest.mark.parametrize("argv,word", [
    (["--quantize-weights", "int4"], "quantize_weights='int4' is not allowed; use None or 'int8' (int4 weights"),
    (["--quantize-grads", "int2"], "quantize_grads='int2' is not allowed; use None, 'int8' or 'int4'"),
    (["--quantize-grads", "int8", "--quant-block", "12"], "quant_block=12 is not allowed; use a power of two >= 8"),
    (["--quantize-weights", "int8", "--quant-block", "4"], "quant_block=4 is not allowed"),
    (["--quant-block", "32"], "quant_block=32 applies to quantized communication only"),
    (["--quant-block", "sixty"], "--quant-block: invalid int value: 'sixty'"),
])
def test_bad_quantization_is_one_line_and_exit_2(capsys, argv, word):
    assert estimate_cli.main(["--params", "10e9", "--ranks", "64"] + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerompi.estimate: error:") and word in err, err


def test_library_checks_too():
    with pytest.raises(zerompi.ConfigError, match="quantize_grads='int3' is not allowed"):
        zerompi.estimate(params=1e6, ranks=4, quantize_grads="int3")


def test_quantized_estimate_runs_without_mpi():
    run = ("import runpy; sys.argv = ['zerompi.estimate'] + sys.argv[1:]; "
           "runpy.run_module('zerompi.estimate', run_name='__main__')")
    out = python_without_mpi(run, "--params", "10e9", "--ranks", "64", "--node-size", "8", "--quantize-grads",
                             "int4").stdout
    assert "unquantized across" in out and "gradients int4 (qgZ" in out
