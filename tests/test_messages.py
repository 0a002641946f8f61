"""The process boundaries speak typed messages (server/messages.py, runtime/sharded.py's rank messages,
runtime/events.py): no tuple with an operation string crosses a pipe, and every message survives the pickling a
pipe does, enums and sampling parameters included."""

from __future__ import annotations

import ast
import multiprocessing
from pathlib import Path

import pytest

import trtserve
from trtserve.runtime.events import Event, Failure, FinishReason, failed, lost
from trtserve.runtime.sampling import RuledOut, SamplingParams
from trtserve.runtime.sharded import Forward, RankAnswer, ReadSlot, RunSlots, WriteSlot
from trtserve.server.messages import AddSequences, CancelSequence, EmbedRows, NewSequence, StepEvents, StopWorker

PACKAGE = Path(trtserve.__file__).parent
LITERALS = (ast.Tuple, ast.List, ast.Dict, ast.Constant, ast.JoinedStr)


def _sent_literals(path: Path) -> list[str]:
    """Calls that put a literal (a tuple, a string, ...) on a pipe, `x.send(...)`, or on the queue a pipe's writer
    thread sends from, `x._outbox.put(...)`, in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (node.func.attr == "send" or (
                node.func.attr == "put" and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "_outbox")) \
                and node.args and isinstance(node.args[0], LITERALS) \
                and not (isinstance(node.args[0], ast.Constant) and node.args[0].value is None):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_no_pipe_carries_a_tuple_with_an_operation_string():
    sites = [site for folder in ("server", "runtime") for path in sorted((PACKAGE / folder).glob("*.py"))
             for site in _sent_literals(path)]
    assert sites == [], f"messages built from literals (use a message class): {sites}"


@pytest.mark.parametrize("message", [
    AddSequences([NewSequence("seq-1", [1, 2, 3], SamplingParams(max_tokens=4, logit_bias=((5, 1.5),)))]),
    CancelSequence("seq-1"),
    StopWorker(),
    StepEvents([Event("seq-1", 7, -0.5, None, FinishReason.LENGTH), lost("seq-2", Failure.WORKER_HUNG)], 1, 2, 3, 1),
    EmbedRows([[1, 2], [3]]),
    Forward([[1, 2]], new=True),
    RunSlots([0], [1, 2], [[3]], False),
    ReadSlot(1, 0, 4),
    WriteSlot(1, {"0:past.0": [1]}),
    RankAnswer(None, 2),
])
def test_every_message_crosses_a_pipe_as_it_was(message):
    ours, theirs = multiprocessing.Pipe()
    ours.send(message)
    got = theirs.recv()
    assert got == message and type(got) is type(message)


def test_a_sequence_ends_by_the_kind_of_its_failure_never_by_its_text():
    ruled_out = failed("a", RuledOut("the request allows no token"))
    other = failed("b", ValueError("no token is left to choose: the request's ... (an error that reads alike)"))
    assert (ruled_out.failure, other.failure) == (Failure.RULED_OUT, Failure.SEQUENCE)
    assert ruled_out.ended and other.ended and not Event("c", 5).ended
    assert Event("c", -1, finish=FinishReason.STOP).ended
    assert FinishReason.LENGTH.value == "length"  # what the API's finish_reason says
