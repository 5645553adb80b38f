"""Offline token data for the GPT: a generated Markov corpus with a known entropy, or a user's file.

Rows of ``seq_len + 1`` tokens (inputs the first ``seq_len``, targets the last); row ``j`` of step ``s``
depends only on (seed, s, j), so each rank builds its own rows and any world size sees the same global batch.
Entropies and losses are in nats per token.
"""
import os
from typing import NamedTuple, Optional

import numpy as np

from ..errors import ConfigError, check
from ..inputs import open_regular

TRAIN, VAL = 1, 2                 # stream ids: training rows and held-out rows never share a seed
GENERATED_VOCAB = 32              # tokens of the generated corpus
FILE_VOCAB = 256                  # tokens of a --data file: its bytes
VAL_SEQUENCES = 256               # rows in the held-out set (fewer if a file's held-out part is short)
VAL_FRACTION = 0.1                # share of a --data file kept for validation (its tail)


class HeldOut(NamedTuple):
    """One evaluation of the held-out set: the mean token loss (nats) and the rows it covers, over every rank
    (``loss`` None: no rank had a row)."""
    loss: Optional[float]
    rows: int

    @classmethod
    def of(cls, summed_loss: float, summed_tokens: float, seq_len: int) -> "HeldOut":
        """From the token losses and the token count, each summed over the ranks."""
        rows = int(round(summed_tokens)) // seq_len
        return cls(summed_loss / summed_tokens if summed_tokens > 0 else None, rows)


def rank_rows(n_rows: int, rank: int, world_size: int) -> range:
    """Rank's contiguous rows of n_rows; the first n_rows % world_size ranks get one more."""
    per, extra = divmod(n_rows, world_size)
    lo = rank * per + min(rank, extra)
    return range(lo, lo + per + (1 if rank < extra else 0))


def held_out_passes(val_size: int, share: int, shares: int, chunk: int = 32):
    """The rows of each pass of share ``share`` of ``shares`` over the held-out set, ``chunk`` at a time: as many
    passes as share 0 (the most rows; stage 3 gathers in each), an empty one where a share ran out."""
    mine = rank_rows(val_size, share, shares)
    passes = -(-len(rank_rows(val_size, 0, shares)) // chunk)
    return [range(min(mine.start + k * chunk, mine.stop), min(mine.start + (k + 1) * chunk, mine.stop))
            for k in range(passes)]


def _row_rng(seed: int, stream: int, step: int, row: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, step, row])


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy in nats along axis (0 log 0 = 0)."""
    logp = np.log(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(axis=axis)


class MarkovCorpus:
    """Sequences from a fixed random order-``order`` Markov chain over ``vocab`` tokens: a random back-off
    n-gram. The row after the last token is drawn from Dirichlet(``concentration``), after each longer context
    from a Dirichlet centred on its one-shorter suffix's row (total concentration ``backoff``), so reading the
    context beats reading the last token; ``smoothing`` of the uniform mixed in keeps it ergodic. Sequences
    start stationary, so the best expected loss of a model seeing the whole prefix is known (``floor``)."""

    def __init__(self, vocab: int = 32, order: int = 2, concentration: float = 0.2, backoff: float = 1.0,
                 seed: int = 0, smoothing: float = 0.01, transitions: Optional[np.ndarray] = None):
        self.vocab, self.order, self.seed = vocab, order, seed
        self.n_states = vocab ** order          # contexts, most significant digit = oldest token
        if transitions is None:
            transitions = self._random_rows(concentration, backoff, smoothing)
        self.transitions = np.asarray(transitions, dtype=np.float64)   # (contexts, vocab) rows sum to 1
        check(self.transitions.shape == (self.n_states, vocab),
              f"transitions have shape {self.transitions.shape}; expected {(self.n_states, vocab)}")
        self.stationary = self._stationary()    # (contexts,) stationary distribution of the context
        self._cdf = np.cumsum(self.transitions, axis=1)
        self._state_cdf = np.cumsum(self.stationary)

    def _random_rows(self, concentration: float, backoff: float, smoothing: float) -> np.ndarray:
        v = self.vocab
        rng = np.random.default_rng([self.seed, 0xC0])
        rows = rng.dirichlet(np.full(v, concentration), size=v)          # context = the last token
        for _ in range(1, self.order):
            # Context (a, rest...) backs off to (rest...): np.tile lines the suffix's row up with it.
            parent = np.tile(rows, (v, 1))
            rows = np.stack([rng.dirichlet(np.maximum(backoff * r, 1e-12)) for r in parent])
        return (1.0 - smoothing) * rows + smoothing / v

    def _stationary(self, tol: float = 1e-14, max_iter: int = 200_000) -> np.ndarray:
        """Power iteration on the context chain: pi'[(b..., x)] = sum_a pi[(a, b...)] P[(a, b...), x]."""
        v, k = self.vocab, self.order
        pi = np.full(self.n_states, 1.0 / self.n_states)
        P = self.transitions.reshape(v, v ** (k - 1), v)
        for _ in range(max_iter):
            new = (pi.reshape(v, v ** (k - 1), 1) * P).sum(axis=0).reshape(-1)
            new /= new.sum()
            if np.abs(new - pi).sum() < tol:
                return new
            pi = new
        raise RuntimeError(f"stationary distribution did not converge in {max_iter} iterations")

    @property
    def entropy_rate(self) -> float:
        """H(X_t | the previous ``order`` tokens) under the stationary chain, nats per token."""
        return float(self.stationary @ _entropy(self.transitions))

    def conditional_entropy(self, context: int) -> float:
        """H(X_c | X_0..X_{c-1}) from a stationary start: the best loss at a target seeing ``context`` tokens."""
        if context >= self.order:
            return self.entropy_rate
        joint = self.stationary.reshape((self.vocab,) * self.order)
        head = lambda m: float(_entropy(joint.sum(axis=tuple(range(m, self.order))).reshape(-1)))
        return head(context + 1) - head(context)

    def floor(self, seq_len: int) -> float:
        """Mean entropy over the ``seq_len`` targets of a row: the lowest expected loss (nats/token)."""
        return float(np.mean([self.conditional_entropy(c) for c in range(1, seq_len + 1)]))

    def sample(self, uniforms: np.ndarray) -> np.ndarray:
        """Rows of tokens by inverse-CDF sampling of uniforms (rows, length) in [0, 1): column 0 picks the starting
        context (its ``order`` tokens), each later one the next token."""
        rows, length = uniforms.shape
        v, k = self.vocab, self.order
        out = np.empty((rows, max(length, k)), np.int64)
        state = np.minimum(np.searchsorted(self._state_cdf, uniforms[:, 0], side="right"), self.n_states - 1)
        for j in range(k):                       # unpack the starting context, oldest token first
            out[:, j] = (state // v ** (k - 1 - j)) % v
        for t in range(k, length):
            nxt = (uniforms[:, t, None] >= self._cdf[state]).sum(axis=1)
            out[:, t] = np.minimum(nxt, v - 1)
            state = (state * v + out[:, t]) % self.n_states
        return out[:, :length]


class GeneratedData:
    """Rows drawn fresh from a MarkovCorpus: unlimited training rows, a fixed held-out set."""

    def __init__(self, seq_len: int, seed: int, vocab: int = GENERATED_VOCAB, order: int = 2,
                 concentration: float = 0.2, backoff: float = 1.0):
        self.seq_len, self.seed = seq_len, seed
        self.corpus = MarkovCorpus(vocab, order, concentration, backoff, seed)
        self.vocab = vocab                                       # token ids are 0..vocab-1
        self.entropy_floor = self.corpus.floor(seq_len)          # nats per token
        self.val_size = VAL_SEQUENCES
        self.source = (f"generated order-{order} Markov corpus, vocab {vocab}, "
                       f"entropy rate {self.corpus.entropy_rate:.4f} nats/token")

    def _rows(self, stream: int, step: int, rows) -> np.ndarray:
        u = np.empty((len(rows), self.seq_len + 1))
        for i, j in enumerate(rows):
            u[i] = _row_rng(self.seed, stream, step, j).random(self.seq_len + 1)
        return self.corpus.sample(u)

    def train_rows(self, step: int, rows) -> np.ndarray:
        """Rows ``rows`` (global indices) of step's batch: int64 array (len(rows), seq_len + 1)."""
        return self._rows(TRAIN, step, rows)

    def val_rows(self, rows) -> np.ndarray:
        """Rows ``rows`` of the held-out set (indices in 0..val_size-1)."""
        return self._rows(VAL, 0, rows)


def check_file(path: str, seq_len: int) -> None:
    """Raise ConfigError unless path is a readable file long enough for training and held-out rows."""
    check(os.path.isfile(path), f"data={path!r} is not a file; give a path to any text or binary file")
    size = os.path.getsize(path)
    # One window for training and one held out; then _val_bytes leaves at least a window to train on.
    check(size >= 2 * (seq_len + 1), f"data={path!r} has {size} bytes; seq_len={seq_len} needs at least "
                                     f"{2 * (seq_len + 1)} (use a longer file or a smaller --seq-len)")


def _val_bytes(size: int, seq_len: int) -> int:
    """Bytes held out at the end of a file: VAL_FRACTION of it, at least one window."""
    return max(seq_len + 1, int(size * VAL_FRACTION))


class FileData:
    """Byte-level tokens (vocab 256) of any file, the last VAL_FRACTION held out. A rank reads its own rows'
    windows with os.pread: a file truncated meanwhile is a one-line error, where a memory map dies of SIGBUS."""

    def __init__(self, path: str, seq_len: int, seed: int):
        check_file(path, seq_len)
        self.seq_len, self.seed, self.path = seq_len, seed, path
        self._file = os.fdopen(open_regular(path, f"data={path!r}"), "rb")   # a FIFO put there since: no hang
        n = os.fstat(self._file.fileno()).st_size
        self.size = n                         # bytes when the run started
        self.n_val = _val_bytes(n, seq_len)
        self.n_train = n - self.n_val
        self.vocab = FILE_VOCAB
        self.entropy_floor = None            # unknown for a user's file
        self.val_size = min(VAL_SEQUENCES, self.n_val - seq_len)
        self.source = f"{path}: {n:,} bytes, byte-level tokens, last {self.n_val:,} held out"

    def __del__(self):
        if getattr(self, "_file", None) is not None:
            self._file.close()

    def _read(self, start: int, length: int) -> np.ndarray:
        """Bytes start .. start + length - 1 of the file as int64 tokens (ConfigError if they are gone)."""
        data = os.pread(self._file.fileno(), length, start)
        if len(data) != length:
            now = os.fstat(self._file.fileno()).st_size
            raise ConfigError(f"data={self.path!r} was truncated while the run reads it: it has {now:,} bytes, "
                              f"{self.size:,} when the run started; restore the file, or train on a copy that "
                              "nothing writes to")
        return np.frombuffer(data, np.uint8).astype(np.int64)

    def _windows(self, starts) -> np.ndarray:
        w = self.seq_len + 1
        if not len(starts):
            return np.empty((0, w), np.int64)
        return np.stack([self._read(s, w) for s in starts])

    def train_rows(self, step: int, rows) -> np.ndarray:
        """Rows ``rows`` of step's batch: windows at random offsets of the training part."""
        hi = self.n_train - self.seq_len            # starts in [0, hi) keep the window inside
        return self._windows([int(_row_rng(self.seed, TRAIN, step, j).integers(hi)) for j in rows])

    def val_rows(self, rows) -> np.ndarray:
        """Rows of the held-out set: windows evenly spaced over the held-out tail."""
        span = self.n_val - self.seq_len            # possible starts inside the held-out part
        starts = [self.n_train + (j * span) // self.val_size for j in rows]
        return self._windows(starts)


def make_data(path: Optional[str], seq_len: int, seed: int):
    """FileData for a path, else the generated corpus."""
    if path:
        return FileData(path, seq_len, seed)
    return GeneratedData(seq_len, seed)
