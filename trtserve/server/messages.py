"""The messages that cross a generation worker's pipe, one class each (pickled as they are). Server to worker:
`AddSequences` (a request's sequences, which join the waiting queue together), `CancelSequence`, `StopWorker`.
Worker to server: `StepEvents` after every step (and a prefill's first tokens before the step's decode call)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trtserve.runtime.events import Event
from trtserve.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class NewSequence:
    id: str
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AddSequences:
    sequences: list[NewSequence]


@dataclass(frozen=True)
class CancelSequence:
    id: str


@dataclass(frozen=True)
class StopWorker:
    pass


@dataclass(frozen=True)
class StepEvents:
    """A step's events and the worker's state after it: sequences running (chunked prefills among them) and
    waiting, and the prompt tokens looked up in its prefix cache and found there since its last message."""

    events: list[Event] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    prefix_queried: int = 0
    prefix_found: int = 0


ToGenerationWorker = AddSequences | CancelSequence | StopWorker


# -- every worker process: its start ------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerReady:
    """The worker loaded its engine: its pid and its backend's own processes (a track engine's ranks)."""

    pid: int
    processes: list[int]


@dataclass(frozen=True)
class WorkerFailed:
    """The worker could not load its engine (the server refuses to start with `error`)."""

    error: str


# -- an embedding worker: a batch of rows at a time ---------------------------------------------------------


@dataclass(frozen=True)
class EmbedRows:
    rows: list[list[int]]


@dataclass(frozen=True)
class Embedded:
    """The backend's outputs for the rows (what TextEngine.encode_ids returns)."""

    outputs: object


@dataclass(frozen=True)
class EmbedFailed:
    error: str
