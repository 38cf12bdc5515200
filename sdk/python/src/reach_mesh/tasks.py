"""Orchestrator tasks as Python values: :class:`Task`, :class:`NodeRun`, :class:`HumanWait`,
:class:`TaskEvent` and :class:`TaskStatus`, read from ``reach.v1`` messages with JSON inputs
and outputs as plain ``dict`` s (see :mod:`reach_mesh.parts` for the number rules)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from reach.v1 import orchestrator_service_pb2 as pb
from reach_mesh.parts import from_value

__all__ = ["ENDED", "HumanWait", "NodeRun", "Task", "TaskEvent", "TaskStatus"]


class TaskStatus(str, enum.Enum):
    """Where a task is in its lifecycle (``reach.v1.TaskStatus`` without its prefix)."""

    UNSPECIFIED = "UNSPECIFIED"
    PENDING = "PENDING"
    DISPATCHED = "DISPATCHED"
    PROCESSING = "PROCESSING"
    WAITING_HUMAN = "WAITING_HUMAN"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    PARTIAL = "PARTIAL"
    CANCELLED = "CANCELLED"

    @classmethod
    def of(cls, number: int) -> TaskStatus:
        """The status numbered ``number`` in ``reach.v1.TaskStatus``."""
        name = pb.TaskStatus.Name(number) if number in pb.TaskStatus.values() else "TASK_STATUS_UNSPECIFIED"
        return cls(name.removeprefix("TASK_STATUS_"))

    @property
    def number(self) -> int:
        """This status's number in ``reach.v1.TaskStatus``."""
        return pb.TaskStatus.Value(f"TASK_STATUS_{self.value}")


#: The statuses a task ends in.
ENDED = frozenset({TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.PARTIAL, TaskStatus.CANCELLED})


def _json(message: Any, field: str) -> Any:
    return from_value(getattr(message, field)) if message.HasField(field) else None


@dataclass(frozen=True)
class NodeRun:
    """One visit of a node: ``node_id``, ``node_type`` (``task``, ``human``, ...), ``status``
    (``RUNNING``, ``SUCCEEDED``, ``FAILED``, ``PARTIAL``, ``CANCELLED``), ``attempts``, the
    JSON ``input`` and ``output`` (masked; ``None`` when unset), the last ``error`` and the
    ``next_node`` chosen."""

    node_id: str
    node_type: str
    status: str
    attempts: int
    input: Any
    output: Any
    error: str
    next_node: str

    @classmethod
    def from_proto(cls, run: pb.NodeRun) -> NodeRun:
        return cls(
            node_id=run.node_id,
            node_type=run.node_type,
            status=pb.NodeStatus.Name(run.status).removeprefix("NODE_STATUS_"),
            attempts=run.attempts,
            input=_json(run, "input"),
            output=_json(run, "output"),
            error=run.error,
            next_node=run.next_node,
        )


@dataclass(frozen=True)
class HumanWait:
    """What a task waiting in a ``human`` node needs: ResumeTask of ``node_id`` with an input
    matching ``input_schema`` (``None``: any input); ``prompt`` is the flow's text for the
    person."""

    node_id: str
    prompt: str
    input_schema: Any


@dataclass(frozen=True)
class Task:
    """One run of a flow.

    Attributes:
        task_id, flow_id, flow_version: which task of which flow version.
        status: its :class:`TaskStatus`.
        current_node: the node it is at (``""`` once it ended).
        input: the task's JSON input (masked).
        output: the task's JSON output once it ended (the last completed node's output);
            ``None`` while it runs.
        error: why it failed, when it did.
        trace_id: the W3C trace id every message of the task carries.
        failed_node: the node a FAILED or PARTIAL task failed at.
        waiting: what it waits for while WAITING_HUMAN; ``None`` otherwise.
        nodes: every node visit in order (GetTask fills it; empty from StartTask and lists).
        proto: the ``reach.v1.Task`` itself.
    """

    task_id: str
    flow_id: str
    flow_version: int
    status: TaskStatus
    current_node: str
    input: Any
    output: Any
    error: str
    trace_id: str
    failed_node: str
    waiting: HumanWait | None
    nodes: tuple[NodeRun, ...]
    proto: pb.Task

    @property
    def ended(self) -> bool:
        """Whether the task ended (SUCCEEDED, FAILED, PARTIAL or CANCELLED)."""
        return self.status in ENDED

    def node(self, node_id: str) -> NodeRun | None:
        """The last visit of ``node_id``; ``None`` when it was not visited."""
        return next((run for run in reversed(self.nodes) if run.node_id == node_id), None)

    @classmethod
    def from_proto(cls, task: pb.Task) -> Task:
        waiting = None
        if task.HasField("waiting"):
            waiting = HumanWait(
                node_id=task.waiting.node_id,
                prompt=task.waiting.prompt,
                input_schema=_json(task.waiting, "input_schema"),
            )
        return cls(
            task_id=task.task_id,
            flow_id=task.flow_id,
            flow_version=task.flow_version,
            status=TaskStatus.of(task.status),
            current_node=task.current_node,
            input=_json(task, "input"),
            output=_json(task, "output"),
            error=task.error,
            trace_id=task.trace_id,
            failed_node=task.failed_node,
            waiting=waiting,
            nodes=tuple(NodeRun.from_proto(run) for run in task.nodes),
            proto=task,
        )


@dataclass(frozen=True)
class TaskEvent:
    """One event of a task's log: its ``sequence`` (from 1), ``kind`` (``node_entered``,
    ``attempt_started``, ...), the ``node_id`` it concerns, its JSON ``detail`` (masked) and the
    task's ``status`` after it."""

    task_id: str
    sequence: int
    kind: str
    node_id: str
    detail: Any
    status: TaskStatus

    @classmethod
    def from_proto(cls, event: pb.TaskEvent) -> TaskEvent:
        return cls(
            task_id=event.task_id,
            sequence=event.sequence,
            kind=event.kind,
            node_id=event.node_id,
            detail=_json(event, "detail"),
            status=TaskStatus.of(event.status),
        )
