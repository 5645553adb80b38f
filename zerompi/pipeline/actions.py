"""A pipeline schedule as data: the ordered list of actions of every rank, and its file format.

An action names what a rank does with one micro-batch ``mb`` on one model chunk ``chunk``
(the model is cut into C chunks of consecutive layers; chunk 0 holds the embedding, chunk C - 1
the head and the loss):

- ``F``: the chunk's forward; ``B``: its backward, the input gradient (and the weight gradient
  too when the schedule has no ``W``); ``W``: the weight gradient, after its ``B`` (zero-bubble
  schedules split the backward so that W fills the bubble);
- ``SEND_F`` / ``RECV_F``: the chunk's output sent to the next chunk's rank / the chunk's input
  received from the previous chunk's rank; ``SEND_B`` / ``RECV_B``: the gradient of the chunk's
  input sent to the previous chunk's rank / the gradient of the chunk's output received from the
  next one's. A RECV posts the receive; the F or B that needs the data waits for it there.

Each chunk lives on one rank (the one that runs its F, B and W). Text: an action is written as
torch.distributed.pipelining writes its CSV schedules, ``{chunk}{kind}{mb}`` (``0F3``,
``1SEND_B0``); a schedule file holds one line per rank, its actions separated by commas, after
an optional line of ``#`` comments. ``read``/``write`` do that; ScheduleError names what is wrong.
"""
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, NamedTuple, Sequence, Tuple

from ..errors import ConfigError
from ..inputs import read_bytes

MAX_FILE_BYTES = 64 << 20    # a schedule file's size, at most: 8 ranks x 100k micro-batches of 1F1B are ~30 MB

KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
COMPUTE = ("F", "B", "W")
_TOKEN = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)")


class ScheduleError(ConfigError):
    """A schedule that cannot run (a bad file, an action out of order, a deadlock): one line, exit 2."""


class Action(NamedTuple):
    kind: str        # one of KINDS
    mb: int          # micro-batch, 0 .. m - 1
    chunk: int       # model chunk, 0 .. C - 1

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind}{self.mb}"


@dataclass(frozen=True)
class Schedule:
    """``ranks`` lists of actions (rank r's in order); ``name`` says what made it."""
    actions: Tuple[Tuple[Action, ...], ...]
    name: str = "custom"

    @property
    def ranks(self) -> int:
        return len(self.actions)

    @cached_property
    def chunks(self) -> int:
        """C, the model chunks (ranks x chunks per rank)."""
        return 1 + max((a.chunk for acts in self.actions for a in acts), default=-1)

    @cached_property
    def micro_batches(self) -> int:
        return 1 + max((a.mb for acts in self.actions for a in acts), default=-1)

    @cached_property
    def split_backward(self) -> bool:
        """True when the backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.kind == "W" for acts in self.actions for a in acts)

    def placement(self) -> Dict[int, int]:
        """{chunk: the rank that computes it} (the first rank found with a compute action of it)."""
        return dict(self._placement)

    @cached_property
    def _placement(self) -> Dict[int, int]:
        out: Dict[int, int] = {}
        for r, acts in enumerate(self.actions):
            for a in acts:
                if a.kind in COMPUTE:
                    out.setdefault(a.chunk, r)
        return out

    def chunks_of(self, rank: int) -> List[int]:
        """The chunks rank ``rank`` computes, in model order."""
        return sorted(c for c, r in self._placement.items() if r == rank)

    def text(self) -> str:
        """The schedule in its file format (see the module docstring)."""
        head = (f"# zerompi pipeline schedule {self.name}: {self.ranks} ranks, {self.chunks} chunks, "
                f"{self.micro_batches} micro-batches; one line per rank\n")
        return head + "".join(",".join(map(str, acts)) + "\n" for acts in self.actions)


def parse_action(token: str, where: str) -> Action:
    m = _TOKEN.fullmatch(token.strip())
    if not m:
        raise ScheduleError(f"{where}: {token.strip()!r} is not an action; write {{chunk}}{{kind}}{{micro-batch}} "
                            f"with kind one of {', '.join(KINDS)} (e.g. 0F3, 1SEND_B0)")
    return Action(m.group(2), int(m.group(3)), int(m.group(1)))


def parse(text: str, name: str = "custom", source: str = "schedule") -> Schedule:
    """The Schedule of ``text`` (the file format); ScheduleError naming the line and token on bad input."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tokens = [t for t in line.split(",") if t.strip()]
        rows.append(tuple(parse_action(t, f"{source} line {n} (rank {len(rows)})") for t in tokens))
    if not rows:
        raise ScheduleError(f"{source}: no actions (one line of comma-separated actions per rank is needed)")
    return Schedule(tuple(rows), name)


def read(path: str) -> Schedule:
    """The schedule in file ``path`` (ScheduleError when it cannot be read or parsed, is not a regular file or is
    larger than MAX_FILE_BYTES)."""
    try:
        text = read_bytes(path, f"schedule file {path!r}", MAX_FILE_BYTES, ScheduleError).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ScheduleError(f"schedule file {path!r} cannot be read ({type(e).__name__}: {e})") from None
    return parse(text, name=f"file {path}", source=path)


def write(schedule: Schedule, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(schedule.text())


def of_rank(actions: Sequence[Sequence[Action]]) -> Schedule:
    return Schedule(tuple(tuple(a) for a in actions))
