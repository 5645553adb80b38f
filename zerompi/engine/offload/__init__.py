"""Offload (ZeRO-Offload, ZeRO-Infinity): the optimizer state in host memory or files, stage 3's
parameter shard in a file (docs/offload.md).

Modules:
- rows: where the rows live (ArrayRows: arrays; ParamFile: stage 3's parameter shard)
- stream: FileRows, the rows in a file, two generations, streamed through a few buffers
- files: the files themselves, whose every read is checked against what was written
- owner: each file's owner, and the start-up check that removes the files of ended runs
"""
from .files import OffloadError, OffloadFile
from .owner import check_dir
from .rows import ROW_NAMES, ArrayRows, ParamFile
from .stream import FileRows

__all__ = ["OffloadError", "OffloadFile", "check_dir", "ROW_NAMES", "ArrayRows", "FileRows", "ParamFile"]
