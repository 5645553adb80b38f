"""estimate()'s arguments from the configs a run is made of: a ZeroConfig (the engine's knobs) and a MeshConfig
(nodes and shard groups), so that ``estimate(params=..., ranks=..., zero=cfg, mesh=mesh)`` describes the run
that ``ZeroEngine(layers, cfg, mesh_config=mesh)`` makes. The keywords of each field keep working beside them."""
import inspect

from ..errors import ConfigError, check

# estimate()'s keywords that are ZeroConfig's fields (the same names, the same meaning)
ZERO_FIELDS = ("dtype", "bucket_mb", "prefetch", "micro_batches", "overlap", "align", "hpz", "offload_optimizer",
               "offload_params", "quantize_weights", "quantize_grads", "quant_block", "optimizer")
MESH_FIELDS = ("node_size", "shard_size")


def with_configs(function, given: dict, zero, mesh) -> dict:
    """``given`` (``function``'s arguments, ``zero`` and ``mesh`` among them) with the configs' fields in place of
    the keywords left at their defaults; ConfigError (one line) for a keyword given that a config contradicts, a
    config of another type, or a mesh with tensor, sequence or pipeline parallelism (the CLI estimates those)."""
    from ..comm.meshconfig import MeshConfig
    from ..engine.config import ZeroConfig
    defaults = {k: p.default for k, p in inspect.signature(function).parameters.items()}
    out = {k: v for k, v in given.items() if k not in ("zero", "mesh")}
    for name, config, kind, keys in (("zero", zero, ZeroConfig, ZERO_FIELDS), ("mesh", mesh, MeshConfig, MESH_FIELDS)):
        if config is None:
            continue
        if not isinstance(config, kind):
            raise ConfigError(f"{name}={config!r:.60} is not allowed; use a zerompi.{kind.__name__} or None")
        for key in keys:
            value = getattr(config, key)
            check(out[key] == defaults[key] or out[key] == value,
                  f"{key}={out[key]!r} and {name}.{key}={value!r} contradict each other; give one")
            out[key] = value
    if mesh is not None:
        check(mesh.tp == mesh.sp == mesh.pp == 1,
              f"mesh={mesh}: estimate() describes ZeRO over plain data parallelism; estimate tp, sp and pp with "
              "python -m zerompi.estimate --tp, --sp, --pp")
    return out
