"""Quantized communication (comm/quantized.py, ZeRO++ qwZ and qgZ): the collectives against the
algorithm written out with the NumPy reference kernels (bit for bit) and the float64 sum (within
the quantization steps), the engine against itself (stages bit-identical for the same settings),
the formulas (wire bytes per level and the logical bytes, to the byte) and the unquantized run
(losses within 2%, DeepSpeed's own convergence check allowing 10%)."""
import json

import numpy as np
import pytest

from tests.mpirun import ROOT, run_mpi
from tests.test_topology import runs, same_bits
from zerompi import ConfigError, ZeroConfig


@pytest.mark.parametrize("n,node", [(4, 2), (3, 3), (4, 4), (6, 3), (6, 2), (4, 1)])
def test_quantized_collectives_match_the_oracle(n, node):
    proc = run_mpi(n, [ROOT / "tests" / "drivers" / "quant_comm.py", node], timeout=120)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * 3 * 3 * 2, proc.stdout
    assert not [r for r in rows if r["wrong"] or r.get("outside")], rows
    for r in (r for r in rows if "bytes" in r):
        assert r["bytes"] == r["formula"] and r["logical"] == r["logical_formula"], r


QUANT = [   # (N, extra config)
    (3, dict(quantize_grads="int8")),
    (3, dict(quantize_grads="int4", quant_block=8, micro_batches=2)),
    (4, dict(quantize_grads="int4", node_size=2, dtype="fp16")),
    (4, dict(quantize_grads="int8", node_size=2, shard_size=2)),
]


@pytest.mark.parametrize("n,extra", QUANT)
def test_qgz_stages_are_bit_identical_and_bytes_match(tmp_path, n, extra):
    base = dict(dict(dtype="fp32", bucket_mb=0.004), **extra)
    out = runs(tmp_path, n, [dict(base, stage=s) for s in range(4)])
    for r in out:
        assert r["bytes_by_level"] == r["formula_by_level"], r["config"]
        assert r["memory"] == r["memory_formula"], r["config"]
    for r in out[1:]:
        assert same_bits(r["params"], out[0]["params"]) and r["losses"] == out[0]["losses"], r["config"]


@pytest.mark.parametrize("n,extra", [(3, dict()), (4, dict(node_size=2, hpz=True, quantize_grads="int4")),
                                     (4, dict(node_size=2, shard_size=2, dtype="fp16"))])
def test_qwz_stages_1_to_3_are_bit_identical_and_bytes_match(tmp_path, n, extra):
    base = dict(dict(dtype="fp32", bucket_mb=0.004, quantize_weights="int8"), **extra)
    hpz = base.pop("hpz", False)
    out = runs(tmp_path, n, [dict(base, stage=s, hpz=hpz and s == 3) for s in (1, 2, 3)])
    for r in out:
        assert r["bytes_by_level"] == r["formula_by_level"], r["config"]
    for r in out[1:]:
        assert same_bits(r["params"], out[0]["params"]) and r["losses"] == out[0]["losses"], r["config"]


def test_quantized_losses_stay_within_two_percent_of_unquantized(tmp_path):
    base = dict(stage=3, dtype="fp32", bucket_mb=0.004)
    variants = [dict(base, quantize_grads="int8"), dict(base, quantize_grads="int4"),
                dict(base, quantize_weights="int8"), dict(base, quantize_weights="int8", quantize_grads="int4"),
                dict(base, quantize_weights="int8", quantize_grads="int4", node_size=2)]
    out = runs(tmp_path, 4, [base] + variants, steps=30)
    plain = np.array(out[0]["losses"])
    for r in out[1:]:
        rel = abs(r["losses"][-1] - plain[-1]) / plain[-1]
        assert rel < 0.02, (r["config"], rel)
        assert not np.allclose(r["losses"], plain, rtol=1e-7), r["config"]   # it did quantize


@pytest.mark.parametrize("kw,match", [
    (dict(quantize_grads="int2"), "quantize_grads='int2' is not allowed"),
    (dict(quantize_weights="int4"), "int4 weights are not offered"),
    (dict(quant_block=4), "quant_block=4 is not allowed; use a power of two >= 8"),
    (dict(quant_block=96), "quant_block=96 is not allowed"),
    (dict(stage=0, quantize_weights="int8"), "needs stage 1, 2 or 3"),
])
def test_bad_quantization_settings_are_one_line_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        ZeroConfig(**kw)


def test_cli_reports_wire_and_logical_bytes(tmp_path):
    out = tmp_path / "m.json"
    run_mpi(4, ["-m", "zerompi.train", "--model", "mlp", "--width", "32", "--depth", "4", "--batch", "16",
                "--steps", "4", "--bucket-mb", "0.004", "--stage", "3", "--quantize-weights", "int8",
                "--quantize-grads", "int4", "--node-size", "2", "--metrics-json", out], timeout=120)
    m = json.loads(out.read_text())
    # What travels, to the byte: payload and scales; the collectives' check headers are counted apart (comm_check_bytes)
    assert m["comm_bytes_per_step_by_level"] == m["comm_theory_bytes_per_step_by_level"]
    assert m["comm_logical_bytes_per_step"] == m["comm_theory_logical_bytes_per_step"]
    assert m["comm_bytes_per_step"] < 0.5 * m["comm_logical_bytes_per_step"]
    assert m["quantization"] == {"weights": "int8", "grads": "int4", "block": 64}
