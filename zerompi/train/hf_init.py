"""``--init-from DIR``: the GPT's initial parameters from a Hugging Face GPT-2 folder, each rank reading its own.

One concern: the import. The folder's config.json gives the model's sizes (checked to be GPT-2's
architecture as zerompi's GPT has it: checkpoint/hf_names.py); its safetensors files (one, or several
named by model.safetensors.index.json) are checked by their headers alone -- every tensor there, of its
shape -- before the job starts. Each parameter then becomes a lazy rule (engine/lazy.py) that reads
its values from the memory-mapped file: the engine makes only a rank's slice of every bucket (a TP
rank's piece of it), so a rank reads only those bytes, and no rank holds the whole model.
"""
import json
import os
from typing import Dict, Optional

from ..checkpoint.hf_names import our_name, read_config, shapes
from ..checkpoint.safetensors_files import INDEX, SINGLE, MappedTensor, read_header
from ..engine.lazy import Lazy
from ..errors import ConfigError, check
from ..inputs import JSON_BYTES, read_bytes

CONFIG = "config.json"
# TrainConfig's fields that the folder's config.json decides, and its key for each.
SIZES = {"n_layer": "n_layer", "n_head": "n_head", "d_model": "d_model", "seq_len": "n_positions"}


def _json(path: str, what: str) -> dict:
    try:
        value = json.loads(read_bytes(path, f"{what} {path!r}", JSON_BYTES))
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from: cannot read {path!r}: {e}")
    check(isinstance(value, dict), f"init_from: {path!r} is not a JSON object")
    return value


def model_sizes(folder: str) -> Dict[str, int]:
    """{vocab, n_positions, n_layer, n_head, d_model} of the GPT-2 folder ``folder``; ConfigError in one line when
    it is not one (no config.json, another architecture)."""
    check(os.path.isdir(folder), f"init_from={folder!r} is not a folder; give a Hugging Face GPT-2 folder "
                                 "(config.json and safetensors)")
    path = os.path.join(folder, CONFIG)
    check(os.path.isfile(path), f"init_from={folder!r} has no {CONFIG}; give a Hugging Face GPT-2 folder "
                                "(save_pretrained's, or export-hf's)")
    return read_config(_json(path, "config"), path)


def apply_sizes(job: dict, folder: str) -> Dict[str, int]:
    """Fill the job's model sizes (TrainConfig fields by name) from ``folder``'s config; ConfigError naming the flag
    when one given contradicts it. Returns the folder's sizes."""
    sizes = model_sizes(folder)
    for field, key in SIZES.items():
        if field in job and job[field] != sizes[key]:
            raise ConfigError(f"--{field.replace('_', '-')} {job[field]} contradicts init_from={folder!r} "
                              f"({key} {sizes[key]} in its {CONFIG}); leave --{field.replace('_', '-')} out")
        job[field] = sizes[key]
    return sizes


class SafetensorsTensor(Lazy):
    """A parameter's values read from a memory-mapped safetensors tensor (float32, converted from its dtype)."""

    def __init__(self, tensor: MappedTensor, name: str):
        super().__init__(tensor.entry.shape)
        self.tensor, self.name = tensor, name

    def fill(self, out, lo, hi, draws) -> None:
        out[:hi - lo] = self.tensor.read(lo, hi)

    def describe(self) -> dict:
        return {"init": "safetensors", "shape": list(self.shape), "file": os.path.basename(self.tensor.path),
                "tensor": self.name, "dtype": self.tensor.entry.dtype}


class HFInit:
    """The folder's tensors by zerompi's parameter names, checked against the sizes of its config."""

    def __init__(self, folder: str):
        self.folder = folder
        self.sizes = model_sizes(folder)
        self.vocab = self.sizes["vocab"]
        want = shapes(self.vocab, self.sizes["n_positions"], self.sizes["n_layer"], self.sizes["d_model"])
        self.tensors: Dict[str, SafetensorsTensor] = {}
        for path in self._files():
            start, entries = read_header(path)
            for hf, entry in entries.items():
                ours = our_name(hf)
                if ours is None:
                    continue
                check(ours in want, f"{path}: tensor {hf!r} does not belong to the {self.sizes['n_layer']}-layer "
                                    f"model of its {CONFIG}")
                check(ours not in self.tensors, f"{path}: tensor {hf!r} is there twice")
                check(entry.shape == want[ours], f"{path}: tensor {hf!r} has shape {list(entry.shape)}; the "
                                                 f"{CONFIG} makes it {list(want[ours])}")
                self.tensors[ours] = SafetensorsTensor(MappedTensor(path, start, entry), hf)
        missing = [n for n in want if n not in self.tensors]
        check(not missing, f"init_from={folder!r}: its safetensors lack tensor "
                           + ", ".join(repr(n) for n in missing[:3]) + (" ..." if len(missing) > 3 else "")
                           + f" of the model its {CONFIG} describes")

    def _files(self):
        index = os.path.join(self.folder, INDEX)
        if os.path.isfile(index):
            weight_map = _json(index, "index").get("weight_map")
            check(isinstance(weight_map, dict) and weight_map, f"init_from: {index!r} has no weight_map")
            names = sorted(set(weight_map.values()))
        else:
            names = [SINGLE]
        for name in names:
            path = os.path.join(self.folder, str(name))
            check(os.path.basename(str(name)) == name and os.path.isfile(path),
                  f"init_from={self.folder!r}: {name!r} is missing; a Hugging Face GPT-2 folder has "
                  f"{SINGLE} or the files its {INDEX} names")
            yield path

    def rule(self, name: str, fresh: Optional[Lazy] = None) -> Lazy:
        """The lazy rule of parameter ``name`` (``fresh``: the model's own, whose shape it must have)."""
        rule = self.tensors[name]
        if fresh is not None and tuple(fresh.shape) != tuple(rule.shape):
            raise ConfigError(f"{name}: shape {rule.shape} in {self.folder!r}, {fresh.shape} in the model")
        return rule


def check_init(cfg, data_vocab: int) -> None:
    """ConfigError unless cfg.init_from's folder, its tensors and the job fit together (every rank, at start);
    ``data_vocab``: the tokens the data may hold."""
    init = HFInit(cfg.init_from)
    check(cfg.resume is None, f"init_from={cfg.init_from!r} starts a run from a model and resume={cfg.resume!r} "
                              "continues one from its checkpoint; give one of the two")
    check(data_vocab <= init.vocab, f"init_from={cfg.init_from!r} has vocab_size {init.vocab}, and the data's "
                                    f"tokens go up to {data_vocab - 1}; use data within the model's vocabulary")
