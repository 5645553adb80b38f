"""``--data FILE --data-format tokens``: a flat file of token ids (nanoGPT's format), uint16 or uint32.

One concern: token files. The file is the ids one after another, little-endian, nothing else
(``python -m zerompi.data prepare`` writes one). It is checked once at start, a block at a time:
its length a whole number of ids, long enough, and every id below the vocabulary (the first one
that is not is named by its position). Then it is read as ``--data`` reads bytes (data.FileData):
each rank reads only the windows of its own rows, with ``os.pread`` (a memory map would die of
SIGBUS if the file were truncated meanwhile), the last VAL_FRACTION of it held out.
"""
import os
from typing import Dict, Optional, Tuple

import numpy as np

from ..errors import ConfigError, check
from ..inputs import open_regular
from .data import VAL_SEQUENCES, FileData, _val_bytes

DTYPES = ("uint16", "uint32")
FORMATS = ("bytes", "tokens")
BLOCK = 1 << 23                       # ids checked at a time
_scanned: Dict[Tuple, Tuple[int, int]] = {}   # (path, size, mtime, dtype) -> (ids, largest id): one scan a process


def scan(path: str, dtype: str, seq_len: int, vocab: Optional[int] = None) -> Tuple[int, int]:
    """(ids, largest id) of the token file ``path``; ConfigError in one line unless it is one: its length a
    multiple of the id size, at least two windows of seq_len + 1 ids, every id below ``vocab`` (when given)."""
    check(dtype in DTYPES, f"token_dtype={dtype!r} is not allowed; use one of {', '.join(DTYPES)}")
    item = np.dtype(dtype).itemsize
    fd = open_regular(path, f"data={path!r}")
    try:
        st = os.fstat(fd)
        check(st.st_size % item == 0, f"data={path!r} has {st.st_size:,} bytes, not a multiple of {item} "
                                      f"({dtype} token ids); is --token-dtype right, or the file cut short?")
        n = st.st_size // item
        check(n >= 2 * (seq_len + 1), f"data={path!r} has {n:,} tokens; seq_len={seq_len} needs at least "
                                      f"{2 * (seq_len + 1)} (use a longer file or a smaller --seq-len)")
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, dtype)
        if key not in _scanned:
            top = 0
            for at in range(0, n, BLOCK):
                ids = np.frombuffer(os.pread(fd, min(BLOCK, n - at) * item, at * item),
                                    np.dtype(dtype).newbyteorder("<"))
                if vocab is not None and int(ids.max()) >= vocab:
                    first = at + int(np.argmax(ids >= vocab))
                    raise ConfigError(f"data={path!r}: token {int(ids[first - at])} at position {first:,} is not "
                                      f"below the vocabulary of {vocab}; give the model's --vocab, or the file "
                                      "its tokenizer made")
                top = max(top, int(ids.max()))
            _scanned[key] = (n, top)
    finally:
        os.close(fd)
    n, top = _scanned[key]
    check(vocab is None or top < vocab, f"data={path!r}: a token id {top} is not below the vocabulary of {vocab}")
    return n, top


class TokenData(FileData):
    """The token file's ids as rows of seq_len + 1 (data.FileData's windows, counted in ids)."""

    def __init__(self, path: str, seq_len: int, seed: int, dtype: str, vocab: int):
        n, _ = scan(path, dtype, seq_len, vocab)
        self.seq_len, self.seed, self.path = seq_len, seed, path
        self.dtype, self.item = np.dtype(dtype).newbyteorder("<"), np.dtype(dtype).itemsize
        self._file = os.fdopen(open_regular(path, f"data={path!r}"), "rb")
        self.size = n * self.item
        self.n_val = _val_bytes(n, seq_len)       # ids held out: the same rule as bytes
        self.n_train = n - self.n_val
        self.vocab = vocab
        self.entropy_floor = None
        self.val_size = min(VAL_SEQUENCES, self.n_val - seq_len)
        self.source = f"{path}: {n:,} {dtype} tokens, vocab {vocab}, last {self.n_val:,} held out"

    def _read(self, start: int, length: int) -> np.ndarray:
        """Ids start .. start + length - 1 as int64 (ConfigError if the file lost them)."""
        data = os.pread(self._file.fileno(), length * self.item, start * self.item)
        if len(data) != length * self.item:
            now = os.fstat(self._file.fileno()).st_size
            raise ConfigError(f"data={self.path!r} was truncated while the run reads it: it has {now:,} bytes, "
                              f"{self.size:,} when the run started; restore the file, or train on a copy")
        return np.frombuffer(data, self.dtype).astype(np.int64)


def data_vocab(cfg) -> int:
    """The vocabulary the GPT's data needs (its largest id + 1, or --vocab): 256 for bytes, 32 generated."""
    from .data import FILE_VOCAB, GENERATED_VOCAB
    if cfg.data is None:
        return GENERATED_VOCAB
    if cfg.data_format != "tokens":
        return FILE_VOCAB
    return cfg.vocab or scan(cfg.data, cfg.token_dtype or DTYPES[0], cfg.seq_len, cfg.vocab)[1] + 1


def model_vocab(cfg) -> int:
    """The GPT's vocabulary: --init-from's config's, else what its data needs (data_vocab)."""
    if cfg.init_from is not None:
        from .hf_init import model_sizes
        return model_sizes(cfg.init_from)["vocab"]
    return data_vocab(cfg)


def make_gpt_data(cfg, vocab: Optional[int] = None):
    """The GPT's data: a token file (--data-format tokens; ``vocab``: the model's, else --vocab or its largest id
    + 1), else data.make_data's bytes or generated corpus."""
    if cfg.data is not None and cfg.data_format == "tokens":
        return TokenData(cfg.data, cfg.seq_len, cfg.seed, cfg.token_dtype or DTYPES[0], vocab or data_vocab(cfg))
    from .data import make_data
    return make_data(cfg.data, cfg.seq_len, cfg.seed)


def check_config(cfg) -> None:
    """ConfigError unless the token flags fit together and the token file is one (every rank, at start)."""
    check(cfg.data_format in FORMATS, f"data_format={cfg.data_format!r} is not allowed; use one of "
                                      f"{', '.join(FORMATS)}")
    tokens = cfg.data_format == "tokens"
    check(not tokens or cfg.data is not None, "data_format='tokens' needs --data FILE (a token file)")
    for name in ("token_dtype", "vocab"):
        check(getattr(cfg, name) is None or tokens,
              f"{name}={getattr(cfg, name)!r} applies with --data-format tokens only; drop it or add that")
    check(cfg.vocab is None or cfg.vocab >= 1, f"vocab={cfg.vocab} must be >= 1")
    if not tokens:
        return
    bound = cfg.vocab
    if cfg.init_from is not None:
        from .hf_init import model_sizes
        bound = bound or model_sizes(cfg.init_from)["vocab"]
    scan(cfg.data, cfg.token_dtype or DTYPES[0], cfg.seq_len, bound)
