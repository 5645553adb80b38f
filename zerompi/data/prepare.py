"""``prepare``: a text file tokenized into a flat token file (nanoGPT's format) for ``--data-format tokens``.

One concern: the offline tokenization. The text is read a block at a time (cut after a newline, so no
word straddles two blocks), encoded with a Hugging Face ``tokenizers`` tokenizer file, or, without one,
with a byte-level BPE of ``--vocab-size`` trained on the text itself (offline; saved beside the output as
``OUT.tokenizer.json``), and the ids written little-endian, uint16 when the vocabulary fits, else uint32.
A progress bar on a terminal; the file is written under a temporary name and renamed.
"""
import argparse
import importlib.util
import os
import sys
import time
from typing import List, Optional

import numpy as np

from ..checkpoint.outputs import check_file, check_roles, write_atomic
from ..errors import ConfigError, OneLineParser, check
from ..inputs import open_regular

BLOCK_BYTES = 1 << 20            # text encoded at a time
SPECIAL = "<|endoftext|>"        # the trained tokenizer's one special token, GPT-2's


def need_tokenizers() -> None:
    check(importlib.util.find_spec("tokenizers") is not None,
          "prepare needs the tokenizers package; pip install 'zerompi[hf]' (or -e '.[hf]' in a checkout)")


def blocks(path: str):
    """The text of ``path`` in blocks of about BLOCK_BYTES, each ending after a newline (the last: the rest),
    with the bytes read so far."""
    fd = open_regular(path, f"text={path!r}")
    done, rest = 0, b""
    with os.fdopen(fd, "rb") as f:
        while True:
            data = f.read(BLOCK_BYTES)
            done += len(data)
            if not data:
                break
            data, cut = rest + data, (rest + data).rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            rest = data[cut:]
            yield data[:cut].decode("utf-8", errors="replace"), done
    if rest:
        yield rest.decode("utf-8", errors="replace"), done


def train_bpe(path: str, vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens trained on the text of ``path`` (GPT-2's pre-tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SPECIAL], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((text for text, _ in blocks(path)), trainer=trainer)
    return tok


def prepare(text: str, out: str, tokenizer: Optional[str] = None, vocab_size: int = 4096,
            token_dtype: Optional[str] = None, progress=None) -> dict:
    """Tokenize ``text`` into ``out``; returns {tokens, vocab, dtype, tokenizer}. ``progress(done, total)`` is
    called after each block."""
    need_tokenizers()
    from tokenizers import Tokenizer
    saved = None
    check(os.path.isfile(text), f"text={text!r} is not a file; give a text file")
    check_roles([("out", out)], [("text", text), ("tokenizer", tokenizer)])
    check_file(out, "out")
    if tokenizer is not None:
        check(os.path.isfile(tokenizer), f"tokenizer={tokenizer!r} is not a file; give a tokenizer.json")
        try:
            tok = Tokenizer.from_file(tokenizer)
        except Exception as e:          # the Rust library's error, whatever its type
            raise ConfigError(f"tokenizer={tokenizer!r} is not a tokenizers file: {str(e).splitlines()[0]}")
    else:
        check(256 + 1 <= vocab_size, f"vocab_size={vocab_size} must be at least 257 (the 256 bytes and {SPECIAL})")
        saved = out + ".tokenizer.json"
        check_file(saved, "tokenizer out")
        tok = train_bpe(text, vocab_size)
    vocab = tok.get_vocab_size()
    dtype = token_dtype or ("uint16" if vocab <= 1 << 16 else "uint32")
    check(dtype in ("uint16", "uint32"), f"token_dtype={dtype!r} is not allowed; use uint16 or uint32")
    check(vocab <= np.iinfo(dtype).max + 1, f"the tokenizer has {vocab} tokens, more than {dtype} holds; "
                                             "use --token-dtype uint32")
    total = os.path.getsize(text)
    count = 0

    def write(f):
        nonlocal count
        for part, done in blocks(text):
            ids = np.asarray(tok.encode(part).ids, np.dtype(dtype).newbyteorder("<"))
            f.write(ids.tobytes())
            count += ids.size
            if progress:
                progress(done, total)
    write_atomic(out, write)
    if saved:
        tok.save(saved)
    return {"tokens": count, "vocab": vocab, "dtype": dtype, "tokenizer": saved or tokenizer}


class Bar:
    """A progress bar on stderr, drawn only for a person at a terminal: ``bar(done, total)`` after each block."""

    def __init__(self):
        self.start = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        frac = done / total if total else 1.0
        rate = done / max(time.monotonic() - self.start, 1e-9) / 2**20
        sys.stderr.write(f"\rprepare [{'#' * int(30 * frac):<30}] {100 * frac:5.1f}%  {rate:.1f} MiB/s")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m zerompi.data", description="Training data made offline (docs/interop.md).")
    sub = p.add_subparsers(dest="command", required=True, metavar="{prepare}", parser_class=OneLineParser)
    r = sub.add_parser("prepare", help="tokenize a text file into a token file (--data-format tokens)",
                       description="Tokenize TEXT into OUT, a flat file of token ids for --data OUT --data-format "
                                   "tokens: with a Hugging Face tokenizer.json, or a byte-level BPE trained on TEXT.")
    r.add_argument("text", metavar="TEXT", help="a UTF-8 text file")
    r.add_argument("--out", required=True, metavar="FILE", help="the token file (written whole, then renamed)")
    r.add_argument("--tokenizer", metavar="JSON", help="a tokenizers file (tokenizer.json); default: train a "
                                                        "byte-level BPE on TEXT, saved as FILE.tokenizer.json")
    r.add_argument("--vocab-size", type=int, default=4096, metavar="V",
                   help="the trained BPE's vocabulary (default 4096; without --tokenizer)")
    r.add_argument("--token-dtype", choices=("uint16", "uint32"),
                   help="the ids' type (default: uint16 when the vocabulary fits, else uint32)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    try:
        a = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        done = prepare(a.text, a.out, a.tokenizer, a.vocab_size, a.token_dtype, Bar())
    except SystemExit as e:          # --help
        return e.code or 0
    except (ConfigError, OSError) as e:
        sys.stderr.write(f"zerompi.data: error: {e}\n")
        return 2
    print(f"wrote {a.out}: {done['tokens']:,} tokens ({done['dtype']}), vocab {done['vocab']}"
          + (f", tokenizer {done['tokenizer']}" if done["tokenizer"] else "")
          + f"; train with --data {a.out} --data-format tokens --token-dtype {done['dtype']} --vocab {done['vocab']}")
    return 0
