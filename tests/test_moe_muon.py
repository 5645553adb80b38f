"""Muon with experts (--optimizer muon --experts E): each expert's weight, a slice of the stacked (E, rows, cols)
parameter, is a matrix of its own; the router and the biases take AdamW. --ep 1, 2, 4 and stages 0-3 give the
same bits; so do --pp 2 (against the unpipelined run) and --tp 2 (stages and EP sizes at the fixed mesh); a
checkpoint saved at --ep 2 resumes at --ep 4 and --ep 1 to the bits of the run that never stopped (pipelined too);
fp16 and shared experts keep the equalities. One step
against a float64 NumPy Muon of the run's first gradient (tests/test_moe_parity.py's float64 model), Newton-Schulz
per expert slice, written from the equations (tests/test_muon.py's oracle)."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_moe_ep import FLAGS, run_many
from tests.test_moe_parity import MOE, SIZES, float64_mean_grads
from tests.test_muon import orthogonalise
from zerompi.errors import ConfigError
from zerompi.train.config import parse_config
from zerompi.train.data import GeneratedData
from zerompi.train.models.gpt import GPT
from zerompi.train.moe.mlp import MoESpec

ROOT = Path(__file__).resolve().parent.parent
MUON = FLAGS + ["--optimizer", "muon"]
ONE = FLAGS[:-4] + ["--steps", "1", "--eval-every", "1", "--optimizer", "muon", "--dtype", "fp32"]
LR, MU = 3e-3, 0.95


def at(ep, stage, dtype="fp32"):
    return ["--ep", str(ep), "--stage", str(stage), "--dtype", dtype]


def same_bits(a, b):
    for key in ("final_params_sha256", "losses", "val_losses"):
        assert a[key] == b[key], (key, a["stage"], a["moe"]["ep"], b["stage"], b["moe"]["ep"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_muon")
    n4 = run_many(4, [MUON + at(1, 0), MUON + at(2, 3), MUON + at(4, 1), MUON + at(2, 2),   # 0-3
                      FLAGS + at(2, 3),                                                      # 4: AdamW
                      ONE + ["--ep", "2", "--stage", "3", "--save-dir", str(d / "one")],      # 5: one step, saved
                      MUON[:-6] + ["--steps", "2", "--optimizer", "muon"] + at(2, 3) + ["--save-dir", str(d / "a")],
                      MUON + at(4, 1) + ["--resume", str(d / "a")],                          # 7: --ep 2 -> 4
                      MUON + at(1, 2) + ["--resume", str(d / "a")]], timeout=600)            # 8: --ep 2 -> 1
    assert len(n4) == 9
    return d, n4


def test_ep_sizes_and_stages_give_the_same_bits(runs):
    _, n4 = runs
    for m in n4[1:4]:
        same_bits(m, n4[0])
    assert n4[0]["losses"][-1] < n4[0]["losses"][0]
    assert n4[4]["final_params_sha256"] != n4[0]["final_params_sha256"]      # AdamW is another run
    # 2 blocks: qkv and proj each, and 4 experts x (fc, out): 20 matrices at --ep 1; at --ep 2 a rank's dense
    # engine has the 4 dense ones and its expert engine 2 experts x 2 x 2 blocks
    assert [n4[i]["muon"]["matrices"] for i in (0, 1, 2)] == [20, 4 + 8, 4 + 4]
    for m in n4[1:4]:
        assert m["muon"]["exchange_bytes_per_step"] == m["muon"]["exchange_bytes_formula"] > 0
    # the expert engine's model states at stage 3, --ep 2: Muon's 16 optimizer bytes per parameter against AdamW's
    # 12 (fp32: 4 + 4 + 16 against 4 + 4 + 12, over its 2 ranks), measured beside it (the same padding, 24/20 x)
    mu, ad = (n4[i]["moe"]["memory_bytes_by_engine"]["experts"] for i in (1, 4))
    assert mu["params"] == ad["params"] and mu["ranks"] == ad["ranks"] == 2
    assert mu["theory"] == 24 * mu["params"] // 2 and ad["theory"] == 20 * ad["params"] // 2
    assert (mu["measured"] - mu["theory"]) * 20 == (ad["measured"] - ad["theory"]) * 24


def test_resume_at_another_ep_gives_the_same_bits(runs):
    """Muon's momentum rows are flat and slice-aligned as AdamW's moments: the experts' reshard by name."""
    _, n4 = runs
    for m in n4[7:9]:
        assert m["first_step"] == 2 and m["losses"] == n4[1]["losses"][2:]
        assert m["final_params_sha256"] == n4[1]["final_params_sha256"]


def test_one_step_matches_the_float64_oracle(runs):
    """The --ep 2 stage 3 run's parameters after one step (consolidated) against float64 NumPy: Muon on every
    expert slice (momentum 0.95, Nesterov: U = 1.95 g at step 1), on the attention's qkv and proj; AdamW on the
    router, the biases, the LayerNorms and the embeddings (its first step: g / (|g| + eps))."""
    d, _ = runs
    out = d / "one.npz"
    proc = subprocess.run([sys.executable, "-m", "zerompi.checkpoint", "consolidate", str(d / "one"), str(out)],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    got = np.load(out)
    g = float64_mean_grads(4)
    spec = MoESpec(MOE["experts"], MOE["top_k"], MOE["hidden"], 1, None, 0.01)
    model = GPT(GeneratedData(SIZES["seq_len"], 0).vocab, seed=0, dtype=np.float64, moe=spec, **SIZES)
    w0 = {k: v.astype(np.float64) for _, p in model.init_layers() for k, v in p.items()}
    assert set(got.files) == set(w0) and got["block1.experts.fc.w"].shape == (4, 16, 24)

    def muon(u):
        return 0.2 * np.sqrt(max(u.shape)) * orthogonalise((1 + MU) * u)

    for k, w in w0.items():
        if k.endswith(("experts.fc.w", "experts.out.w")):
            want = w - LR * np.stack([muon(g[k][e]) for e in range(w.shape[0])])
            # the stack as one (E rows, cols) matrix would be another update: the test tells them apart
            whole = w - LR * muon(g[k].reshape(-1, w.shape[-1])).reshape(w.shape)
            assert np.max(np.abs(whole - want)) > 1e-2 * np.max(np.abs(want - w)), k
        elif k.endswith(("qkv.w", "proj.w")):
            want = w - LR * muon(g[k])
        else:
            want = w - LR * g[k] / (np.abs(g[k]) + 1e-8)
        change = np.max(np.abs(want - w))
        assert change > 0, k
        err = np.max(np.abs(got[k] - want)) / change
        if k.endswith(("experts.fc.w", "experts.out.w", "qkv.w", "proj.w")):
            # fp32 rounding of the gradient and of 5 float32 Newton-Schulz iterations (measured: 2.3e-6 to 3.7e-6
            # of the largest change on the experts, up to 8.4e-6 on qkv, proj; tests/test_muon.py's bound)
            assert err <= 2e-5, k
        else:   # AdamW's first step g / (|g| + 1e-8) turns the fp32 gradient's rounding near g = 0 into more
            assert err <= 1e-3, k       # (measured: 1.7e-4 at most, the qkv biases, whose key part has g ~ 0)


def test_pipelined_and_tensor_parallel_give_the_same_bits():
    """--pp 2 against the unpipelined run of the same global batch (N=2, --ep 2), both at stages 1 and 3;
    --tp 2 at N=4: stages 0-3 and --ep 1, 2 give the same bits (each TP piece of qkv, proj a matrix)."""
    mb = ["--micro-batches", "2"]
    flat = run_many(2, [MUON + at(2, 1) + mb, MUON + at(2, 3) + mb])
    piped = run_many(4, [MUON + at(2, 1) + mb + ["--pp", "2"], MUON + at(2, 3) + mb + ["--pp", "2"]])
    assert len(flat) == len(piped) == 2
    for a, b in zip(flat, piped):
        assert b["pipeline"] is not None
        same_bits(a, b)
    tp = run_many(4, [MUON + at(1, 0) + ["--tp", "2"], MUON + at(2, 3) + ["--tp", "2"],
                      MUON + at(2, 1) + ["--tp", "2"]])
    assert len(tp) == 3
    for m in tp[1:]:
        same_bits(m, tp[0])


def test_default_patterns_leave_the_router_to_adamw():
    cfg = parse_config(["--experts", "4", "--optimizer", "muon"])
    assert cfg.zero.muon_params == ("*.qkv.w", "*.proj.w", "*.fc.w", "*.out.w")
    assert "*.experts.fc.w" in cfg.zero.muon_stacked and "*.experts.fc.b" in cfg.zero.muon_stacked
    assert parse_config(["--optimizer", "muon"]).zero.muon_params == ("*.w",)       # the dense GPT's
    assert parse_config(["--optimizer", "muon"]).zero.muon_stacked == ()
    assert parse_config(["--experts", "4"]).zero.muon_stacked == ()                 # AdamW: no stacks
    from zerompi.train.report import _optimizer_words        # the banner says so
    assert "(each expert a matrix)" in _optimizer_words(cfg.zero)
    assert "each expert" not in _optimizer_words(parse_config(["--optimizer", "muon"]).zero)


def test_stacks_of_vectors_are_no_matrices():
    """engine/matrix_owners: with '*', a stacked bias (E, cols) is a stack of vectors (AdamW), the stacked weight
    (E, rows, cols) E matrices, a plain 2-D weight one; a pattern matching only stacked biases is refused."""
    from zerompi.engine.matrix_owners import matrices_of, muon_names
    from zerompi.errors import AgreedConfigError
    from zerompi.layout import FlatLayout
    shapes = {"r.w": (8, 4), "e.w": (4, 8, 6), "e.b": (4, 6), "v": (8,)}
    stacked = ("e.*",)
    names = muon_names(shapes, ("*",), stacked)
    assert names == ["r.w", "e.w"]
    layout = FlatLayout([("l", list(shapes.items()))], 1, 10 ** 6, 16)
    mats = matrices_of(layout, names, stacked)
    assert [(m[0], m[2], m[3]) for m in mats] == [("r.w", 0, (8, 4))] + [
        (f"e.w[{e}]", e * 48, (8, 6)) for e in range(4)]
    with pytest.raises(AgreedConfigError, match="match no 2-D"):
        muon_names(shapes, ("e.b",), stacked)


def test_a_pattern_of_no_parameter_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--experts", "4", "--steps", "1", "--optimizer",
                           "muon", "--muon-params", "*.nothing"], capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "'*.nothing'" in proc.stderr, proc.stderr


def test_offload_is_refused_with_experts_as_without():
    with pytest.raises(ConfigError, match="not available with optimizer='muon' yet"):
        parse_config(["--experts", "4", "--optimizer", "muon", "--offload-optimizer", "cpu"])


def test_fp16_and_shared_experts_give_the_same_bits_at_every_ep():
    """fp16 (the loss scale, stored fp16 weights), and shared experts (a dense stack: S matrices) with dense
    blocks between the MoE ones (--moe-every 2, their fc and out matrices), at --ep 1, 2, 4 and several stages."""
    shared = ["--shared-experts", "1", "--n-layer", "4", "--moe-every", "2"]
    runs = run_many(4, [MUON + at(1, 0, "fp16"), MUON + at(2, 3, "fp16"), MUON + at(4, 1, "fp16"),
                        MUON + shared + at(1, 0), MUON + shared + at(2, 3), MUON + shared + at(4, 2)])
    assert len(runs) == 6
    for i in (1, 2, 4, 5):
        same_bits(runs[i], runs[i - 1 - (i - 1) % 3])
    # 2 dense blocks x 4, 2 MoE blocks x (qkv, proj, 1 shared x 2, 4 experts x 2): 32 matrices at --ep 1
    assert runs[3]["muon"]["matrices"] == 32


def test_pipelined_checkpoints_resume_at_another_ep(tmp_path):
    """--pp 2 --ep 2 (N=4) saved after step 2 at stage 3, resumed at --ep 1 stage 1 and --ep 2 stage 2: the bits of
    the run that never stopped (each stage's expert engine reshards Muon's momentum by name)."""
    from tests.test_moe_pipeline_ep import FLAGS as PP, run_many as run_pp
    m = PP[:-4] + ["--eval-every", "4", "--optimizer", "muon", "--dtype", "fp32", "--pp", "2", "--steps"]
    runs = run_pp(4, [m + ["4"] + at(2, 3)[:4], m + ["2"] + at(2, 3)[:4] + ["--save-dir", str(tmp_path)],
                      m + ["4"] + at(1, 1)[:4] + ["--resume", str(tmp_path)],
                      m + ["4"] + at(2, 2)[:4] + ["--resume", str(tmp_path)]], timeout=600)
    assert len(runs) == 4
    for r in runs[2:]:
        assert r["first_step"] == 2 and r["losses"] == runs[0]["losses"][2:]
        assert r["final_params_sha256"] == runs[0]["final_params_sha256"]


def test_simulated_world_is_one_line_as_without_experts():
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--experts", "4", "--ep", "2", "--optimizer",
                           "muon", "--simulate-world", "4", "--steps", "1"], capture_output=True, text=True,
                          timeout=300, cwd=str(ROOT))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "not available on a simulated world yet" in proc.stderr
