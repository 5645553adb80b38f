"""Configs by concern: MeshConfig apart from ZeroConfig (ZeroConfig(tp=...) deprecated, still taken), the
train CLI's flags made from the fields, and estimate() taking the same configs."""
import warnings
from dataclasses import fields

import pytest

import zerompi
from zerompi import ConfigError, MeshConfig, ZeroConfig
from zerompi.flags import flag_name
from zerompi.pipeline.config import PipelineConfig
from zerompi.train.config import TrainConfig, build_parser, parse_config


def test_mesh_values_are_checked_in_one_line():
    for kw, msg in ((dict(tp=0), "tp=0 must be a whole number of ranks >= 1 (tensor-parallel group size)"),
                    (dict(pp=True), "pp=True is a bool; give a whole number (an int)"),
                    (dict(sp=2.0), "sp=2.0 is a float; give a whole number (an int: 2)"),
                    (dict(node_size=0), "node_size=0 must be a whole number of ranks >= 1 (or None)"),
                    (dict(node_size=2, shard_size=3), "shard_size=3 is not a multiple of node_size=2")):
        with pytest.raises(ConfigError) as e:
            MeshConfig(**kw)
        assert str(e.value).startswith(msg), e.value


def test_zero_config_takes_the_mesh_for_one_release_with_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = ZeroConfig(stage=3)                     # no warning without the moved fields
    assert plain.tp == 1 and plain.node_size is None and "tp" not in plain.to_dict()
    with pytest.warns(DeprecationWarning, match=r"ZeroConfig\(tp, node_size=...\) is deprecated"):
        old = ZeroConfig(tp=2, node_size=4)
    assert (old.tp, old.node_size, old.mesh) == (2, 4, MeshConfig(tp=2, node_size=4))
    assert TrainConfig(model="mlp", zero=old).mesh == old.mesh     # a TrainConfig made the old way
    with pytest.raises(ConfigError, match="ZeroConfig has no field 'tq'"):
        ZeroConfig(tq=2)


def test_every_flagged_field_is_a_flag_of_the_train_cli():
    text = build_parser().format_help()
    for cls in (TrainConfig, ZeroConfig, MeshConfig, PipelineConfig):
        for f in fields(cls):
            if "flag" in f.metadata:
                assert flag_name(cls, f.name) in text, (cls.__name__, f.name)
    assert "--decay-all" in text and "(default 65536)" in text


def test_the_cli_fills_each_config_of_its_concern():
    cfg = parse_config(["--model", "mlp", "--tp", "2", "--node-size", "4", "--loss-scale", "8", "--no-overlap"],
                       environ={})
    assert cfg.mesh == MeshConfig(tp=2, node_size=4)
    assert (cfg.zero.init_loss_scale, cfg.zero.overlap, cfg.zero.no_decay) == (8.0, False, ())
    pp = parse_config(["--pp", "2", "--micro-batches", "2", "--pp-grad-reduce", "step"], environ={})
    assert pp.mesh.pp == 2 and pp.pipeline.grad_reduce == "step"
    for argv, msg in ((["--loss-scale", "0"], "--loss-scale: init_loss_scale=0.0 must be > 0"),
                      (["--chunks", "2"], "--chunks 2 applies with --pp > 1 only; drop it or add --pp"),
                      (["--tp", "0"], "tp=0 must be a whole number of ranks >= 1")):
        with pytest.raises(ConfigError) as e:
            parse_config(argv, environ={})
        assert str(e.value).startswith(msg), e.value


def test_estimate_takes_the_configs_of_a_run():
    zero, mesh = ZeroConfig(dtype="bf16", stage=3, hpz=True, bucket_mb=4.0), MeshConfig(node_size=4, shard_size=8)
    by_keywords = zerompi.estimate(params=1e9, ranks=16, dtype="bf16", bucket_mb=4.0, hpz=True, node_size=4,
                                   shard_size=8)
    assert zerompi.estimate(params=1e9, ranks=16, zero=zero, mesh=mesh) == by_keywords
    for kw, msg in ((dict(dtype="fp32", zero=zero), "dtype='fp32' and zero.dtype='bf16' contradict each other"),
                    (dict(mesh=MeshConfig(tp=2)), "mesh=MeshConfig(tp=2, "),
                    (dict(zero={"dtype": "bf16"}), "zero={'dtype': 'bf16'} is not allowed; use a zerompi.ZeroConfig")):
        with pytest.raises(ConfigError) as e:
            zerompi.estimate(params=1e9, ranks=16, **kw)
        assert str(e.value).startswith(msg), e.value
