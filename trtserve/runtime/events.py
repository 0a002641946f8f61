"""What a decode step says about each sequence, as a batcher produces it and the server receives it: a new token,
the sequence's end (`FinishReason`) or its failure (`Failure`, a kind the server answers by, with a message for
people). These cross the generation worker's pipe as they are (server/messages.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a sequence ended, as OpenAI's `finish_reason` names it."""

    STOP = "stop"  # end-of-sequence, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the context is full


class Failure(StrEnum):
    """Why a sequence ended without finishing, by who is at fault."""

    RULED_OUT = "ruled_out"  # the request's own constraints leave no token to choose: a bad request
    SEQUENCE = "sequence"  # this sequence's computation failed (its logits are not numbers, a step raised)
    WORKER_DIED = "worker_died"  # the worker process holding it is gone
    WORKER_HUNG = "worker_hung"  # the worker stopped making progress and is being restarted


@dataclass
class Event:
    """A new token (token -1 when the sequence ended on end-of-sequence) or a failure."""

    id: str
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token, logprob) of the likeliest, likeliest first
    finish: FinishReason | None = None
    error: str | None = None  # what failed, for people
    failure: Failure | None = None  # set with `error`
    # (token, logprob, top_logprobs) of each prompt token, on the first event when the sequence asked for them
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] | None = None

    @property
    def ended(self) -> bool:
        return self.finish is not None or self.failure is not None


def failed(seq_id: str, exc: BaseException) -> Event:
    """The event that ends a sequence on `exc`: the failure kind the exception's class names (`failure`, as
    sampling.RuledOut's), else the sequence's own failure."""
    kind = getattr(type(exc), "failure", Failure.SEQUENCE)
    return Event(seq_id, -1, error=f"{type(exc).__name__}: {exc}", failure=kind)


def lost(seq_id: str, why: Failure) -> Event:
    """The event of a sequence whose worker is gone (`why`: WORKER_DIED or WORKER_HUNG)."""
    return Event(seq_id, -1, error=why.value, failure=why)
