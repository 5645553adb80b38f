"""Bad MoE input: one line naming the value and what is allowed, exit 2, on every rank."""
import pytest

from tests.mpirun import one_line, run_mpi
from zerompi.errors import ConfigError
from zerompi.train.config import parse_config

REFUSED = [
    (["--experts", "4", "--top-k", "5"], "top_k=5 is more than experts=4"),
    (["--experts", "6", "--ep", "4"], "experts=6 is not divisible by ep=4"),
    (["--experts", "4", "--capacity-factor", "0"], "capacity_factor=0.0 must be > 0"),
    (["--experts", "4", "--capacity-factor", "-1"], "capacity_factor=-1.0 must be > 0"),
    (["--experts", "-1"], "experts=-1 must be an integer >= 0"),
    (["--experts", "4", "--moe-every", "0"], "moe_every=0 must be an integer >= 1"),
    (["--experts", "4", "--aux-coef", "-0.1"], "aux_coef=-0.1 must be >= 0"),
    (["--experts", "4", "--ep", "0"], "ep=0 must be an integer >= 1"),
    (["--top-k", "2"], "top_k=2 (--top-k) applies with --experts > 0 only"),
    (["--ep", "2"], "ep=2 (--ep) applies with --experts > 0 only"),
    (["--experts", "4", "--bias-update", "-1"], "bias_update=-1.0 must be >= 0"),
    (["--experts", "4", "--shared-experts", "-1"], "shared_experts=-1 must be an integer >= 0"),
    (["--shared-experts", "1"], "shared_experts=1 (--shared-experts) applies with --experts > 0 only"),
    (["--model", "mlp", "--experts", "4"], "experts=4 applies to model gpt only"),
    (["--experts", "4", "--ep", "2", "--quantize-grads", "int8"], "--quantize-grads with --ep 2 is not supported yet"),
    (["--experts", "4", "--ep", "2", "--stage", "3", "--quantize-weights", "int8"],
     "--quantize-weights with --ep 2 is not supported yet"),
]


@pytest.mark.parametrize("argv,needle", REFUSED)
def test_refused_in_one_line(argv, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(argv, environ={})
    assert str(e.value).startswith(needle), e.value


def test_init_from_is_refused_in_one_line(tmp_path):
    """A GPT-2 folder has dense MLPs: --init-from with --experts is refused at parse, naming both."""
    import json
    from zerompi.checkpoint.hf_names import gpt2_config
    (tmp_path / "config.json").write_text(json.dumps(gpt2_config(256, 64, 2, 4, 64)))
    with pytest.raises(ConfigError) as e:
        parse_config(["--experts", "4", "--init-from", str(tmp_path)], environ={})
    assert str(e.value).startswith("--init-from with --experts 4 is not supported"), e.value


def test_accepted():
    cfg = parse_config(["--experts", "8", "--top-k", "1", "--capacity-factor", "1.25", "--moe-every", "2"],
                       environ={})
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.moe.capacity_factor, cfg.moe.moe_every) == (8, 1, 1.25, 2)
    cfg = parse_config(["--experts", "4", "--tp", "2", "--ep", "2", "--stage", "3"], environ={})
    assert (cfg.mesh.tp, cfg.moe.ep) == (2, 2)
    cfg = parse_config(["--experts", "4", "--sp", "2", "--ep", "2", "--capacity-factor", "1.5"], environ={})
    assert (cfg.mesh.sp, cfg.moe.ep, cfg.moe.capacity_factor) == (2, 2, 1.5)
    cfg = parse_config(["--experts", "4", "--sp", "2", "--pp", "2", "--ep", "2", "--micro-batches", "2"],
                       environ={})   # tests/test_moe_pipeline_ep.py
    assert (cfg.mesh.sp, cfg.mesh.pp, cfg.moe.ep) == (2, 2, 2)
    assert parse_config(["--experts", "4", "--ep", "2", "--checkpoint-activations"], environ={}).checkpoint_activations
    for argv in (["--node-size", "2", "--shard-size", "2"], ["--stage", "3", "--hpz"], ["--trace", "t.json"],
                 ["--comm-progress", "thread"], ["--offload-optimizer", "cpu", "--offload-delayed-update"],
                 ["--stage", "3", "--offload-optimizer", "nvme", "--offload-params", "nvme", "--offload-dir", "."]):
        # tests/test_moe_nodes.py
        parse_config(["--experts", "4", "--ep", "2"] + argv, environ={})
    assert not parse_config([], environ={}).moe.on


def test_checkpoints_accepted_with_ep_and_bias_update():
    """Checkpoints of an --ep run and of --bias-update's biases are built (train/moe/checkpoints.py)."""
    for extra in (["--ep", "2", "--save-dir", "x", "--async-save"], ["--ep", "2", "--resume", "x"],
                  ["--bias-update", "0.01", "--save-dir", "x"],
                  ["--bias-update", "0.01", "--ep", "2", "--resume", "x"]):
        cfg = parse_config(["--experts", "4"] + extra, environ={})
        assert cfg.moe.on and (cfg.save_dir or cfg.resume) == "x"


@pytest.mark.every_mpi
@pytest.mark.parametrize("flags,needle", [
    (["--experts", "4", "--top-k", "5"], "top_k=5 is more than experts=4"),
    (["--model", "mlp", "--experts", "4"], "experts=4 applies to model gpt only"),
    (["--experts", "4", "--ep", "4"], "ep=4 does not divide the 2 ranks"),
    (["--experts", "4", "--shared-experts", "-2"], "shared_experts=-2 must be an integer >= 0"),
    (["--experts", "4", "--tp", "2", "--ep", "2"], "ep=2 does not divide the 1 data-parallel ranks (2 ranks / tp 2)"),
])
def test_every_rank_exits_2_with_one_line(flags, needle):
    proc = run_mpi(2, ["-m", "zerompi.train"] + flags, timeout=60, check=False)
    one_line(proc, 2, needle)
