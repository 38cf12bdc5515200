"""The A2A v1 edge of ``reach dev``, end to end, through the official A2A SDK (a2a-sdk) over
both of its bindings (JSON-RPC over HTTP, gRPC ``lf.a2a.v1.A2AService``): discovery (agent
cards), messages to capabilities, flow tasks that stream, wait for a person and resume,
cancellation, resumable streams (``Last-Event-ID``), protocol versions, GetTask / ListTasks.

One ``reach dev`` (with its example agents and the example flows, plus one flow of this file)
serves the whole module: the agents take seconds to start. Every test makes tasks of its own
(its own complaint ids and contexts) and depends on no other test's."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import pytest
import yaml  # type: ignore[import-untyped]
from a2a.client import A2ACardResolver, Client, ClientCallContext, ClientConfig, ClientFactory
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    ListTaskPushNotificationConfigsRequest,
    TaskPushNotificationConfig,
    ROLE_AGENT,
    ROLE_USER,
    TASK_STATE_CANCELED,
    TASK_STATE_COMPLETED,
    TASK_STATE_FAILED,
    TASK_STATE_INPUT_REQUIRED,
    TASK_STATE_REJECTED,
    TASK_STATE_SUBMITTED,
    TASK_STATE_WORKING,
    AgentCard,
    CancelTaskRequest,
    GetExtendedAgentCardRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf import json_format, struct_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status  # type: ignore[import-untyped]

from conftest import REPO, START_TIMEOUT, ReachProcess, eventually

COMPLAINT_FLOW = REPO / "examples/flows/complaint-flow.yaml"
PROTOCOLS = REPO / "examples/protocol-registry.yaml"

#: A narrative the rules classifier recognises nothing in: confidence 0, so complaint-flow
#: sends it to its `human_review` node.
VAGUE = "I am not happy with this."
#: A narrative the rules classifier calls servicing with confidence 1.
CONFIDENT = "I was charged a late fee although my autopay payment was set up"

#: A flow of this module: a person approves, the complaint is classified, a person checks the
#: classification. It waits twice, so a stream can be dropped and the task advanced without
#: the task ending (SubscribeToTask refuses a terminal task).
TWO_REVIEWS = """\
id: a2a-two-reviews
version: 1
description: A person approves the complaint, the coordinator classifies it, a person checks that.
initial: first_review
states:
  first_review:
    type: human
    prompt: "Approve the complaint for classification."
    schema:
      type: object
      required: [approve]
      properties:
        approve: {type: boolean}
    next: classify
  classify:
    type: task
    capability: complaint.classify
    timeout: 30s
    next: second_review
  second_review:
    type: human
    prompt: "Check the classification."
    next: done
  done: {type: succeed}
"""

BINDINGS = pytest.mark.parametrize("binding", ["JSONRPC", "GRPC"])
TERMINAL = {TASK_STATE_COMPLETED, TASK_STATE_FAILED, TASK_STATE_CANCELED, TASK_STATE_REJECTED}
#: The skills the example fleet and the flows give the mesh's card, once every agent is up.
EXPECTED_SKILLS = {
    "complaint.classify",
    "complaint.servicing",
    "complaint.repayment",
    "complaint.credit_report",
    "complaint.origination",
    "flow:complaint-flow",
    "flow:a2a-two-reviews",
}


class EdgeProcess(ReachProcess):
    """``reach dev`` with its A2A edge: besides the mesh's gRPC endpoint, the banner's ``a2a``
    line gives the edge's HTTP base URL (:attr:`a2a_url`, ``http://127.0.0.1:PORT``) and the
    address of its gRPC ``lf.a2a.v1.A2AService`` (:attr:`a2a_grpc`, ``127.0.0.1:PORT``)."""

    banner_lines = {
        "a2a": rb"a2a\s+(https?://127\.0\.0\.1:\d+)/\.well-known/agent-card\.json",
        "a2a_grpc": rb"gRPC lf\.a2a\.v1\.A2AService at (127\.0\.0\.1:\d+)\)",
    }

    @property
    def a2a_url(self) -> str:
        return self.banner_values["a2a"]

    @property
    def a2a_grpc(self) -> str:
        return self.banner_values["a2a_grpc"]


def _wait_for_skills(edge: EdgeProcess) -> None:
    """Waits until the mesh's card lists every skill of :data:`EXPECTED_SKILLS` (the agents
    registered and READY, the flows loaded)."""
    deadline = time.monotonic() + 30
    last: Any = None
    with httpx.Client(timeout=5) as http:
        while time.monotonic() < deadline:
            try:
                response = http.get(f"{edge.a2a_url}/.well-known/agent-card.json")
                last = response.text
                if response.status_code == 200:
                    skills = {skill["id"] for skill in response.json().get("skills", [])}
                    if EXPECTED_SKILLS <= skills:
                        return
                    last = sorted(skills)
            except httpx.HTTPError as error:
                last = error
            time.sleep(0.1)
    pytest.fail(f"the mesh's agent card did not list {sorted(EXPECTED_SKILLS)} within 30s (last: {last!r})", pytrace=False)


@pytest.fixture(scope="module")
def edge() -> Iterator[EdgeProcess]:
    """``reach dev`` with the example agents and the A2A edge, started from the repository
    (so it finds examples/protocol-registry.yaml) with the example complaint flow and
    :data:`TWO_REVIEWS` as its flows, tasks in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="reach-a2a-") as tmp:
        root = Path(tmp)
        flows = root / "flows"
        flows.mkdir()
        shutil.copy(COMPLAINT_FLOW, flows / COMPLAINT_FLOW.name)
        (flows / "a2a-two-reviews.yaml").write_text(TWO_REVIEWS)
        process = EdgeProcess(
            [
                "dev",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "",
                "--edge-listen",
                "127.0.0.1:0",
                "--data-dir",
                str(root / "data"),
                "--flows",
                str(flows),
            ],
            cwd=REPO,
            log=root / "reach-dev.log",
            # A webhook that is down is retried after 100 ms, not 1 s (doubling either way).
            env={"REACH_ORCHESTRATOR__WEBHOOK_BACKOFF": "100ms"},
        )
        try:
            _wait_for_skills(process)
            yield process
        finally:
            process.stop()


# ---- helpers ---------------------------------------------------------------------------------


async def fetch_card(edge: EdgeProcess, agent: str = "") -> AgentCard:
    """The mesh's card (``agent`` empty) or one service's (``/agents/<service>``), through
    a2a-sdk's resolver."""
    async with httpx.AsyncClient(timeout=10) as http:
        return await A2ACardResolver(http, edge.a2a_url + agent).get_agent_card()


@asynccontextmanager
async def connect(card: AgentCard, binding: str, *, streaming: bool = True) -> AsyncIterator[Client]:
    """An a2a-sdk client of ``card`` over ``binding`` (``JSONRPC`` or ``GRPC``)."""
    config = ClientConfig(
        streaming=streaming,
        supported_protocol_bindings=[binding],
        use_client_preference=True,
        grpc_channel_factory=lambda url: grpc.aio.insecure_channel(url),
    )
    client = ClientFactory(config).create(card)
    try:
        yield client
    finally:
        await client.close()


def data_part(value: dict[str, Any]) -> Part:
    part = Part()
    part.data.CopyFrom(json_format.ParseDict(value, struct_pb2.Value()))
    return part


def text_part(text: str) -> Part:
    return Part(text=text)


def data_of(part: Part) -> Any:
    """A data part's value as Python."""
    assert part.WhichOneof("content") == "data", f"not a data part: {part}"
    return json_format.MessageToDict(part.data)


def user_message(*parts: Part, skill: str | None = None, task_id: str = "", context_id: str = "") -> Message:
    message = Message(
        message_id=str(uuid.uuid4()), role=ROLE_USER, parts=list(parts), task_id=task_id, context_id=context_id
    )
    if skill is not None:
        message.metadata.update({"skill": skill})
    return message


def request(
    message: Message,
    *,
    return_immediately: bool = False,
    history_length: int | None = None,
    skill: str | None = None,
) -> SendMessageRequest:
    result = SendMessageRequest(message=message)
    result.configuration.return_immediately = return_immediately
    if history_length is not None:
        result.configuration.history_length = history_length
    if skill is not None:
        result.metadata.update({"skill": skill})
    return result


def complaint(narrative: str) -> dict[str, Any]:
    """A ``complaint.submitted`` payload with an id of its own."""
    return {"complaint_id": f"a2a-{uuid.uuid4().hex[:12]}", "narrative": narrative, "product": "Student loan"}


def kind(event: StreamResponse) -> str:
    which = event.WhichOneof("payload")
    assert which is not None, f"an empty StreamResponse: {event}"
    return str(which)


def state(event: StreamResponse) -> TaskState | None:
    """The task state an event reports (a task snapshot or a status update), else None."""
    if kind(event) == "task":
        return event.task.status.state
    if kind(event) == "status_update":
        return event.status_update.status.state
    return None


def sequence(event: StreamResponse) -> int:
    """``metadata["reach.sequence"]`` of a task, status update or artifact update."""
    payload = getattr(event, kind(event))
    metadata: struct_pb2.Struct = payload.metadata
    assert "reach.sequence" in metadata, f"{kind(event)} without metadata reach.sequence: {event}"
    value = metadata["reach.sequence"]
    assert isinstance(value, float) and value == int(value), f"reach.sequence is not an integer: {value!r}"
    return int(value)


def show(events: list[StreamResponse]) -> str:
    """Events in one line each, for assertion messages."""
    lines = []
    for event in events:
        which = kind(event)
        payload = getattr(event, which)
        seq = payload.metadata["reach.sequence"] if "reach.sequence" in payload.metadata else None
        if which == "artifact_update":
            what = f"artifact {event.artifact_update.artifact.artifact_id}"
        elif which == "message":
            what = "message"
        else:
            found = state(event)
            what = TaskState.Name(found) if found is not None else "?"
        lines.append(f"  {which} {what} seq={seq}")
    return "\n".join(lines)


async def read(
    stream: AsyncIterator[StreamResponse],
    until: Callable[[StreamResponse], bool] | None = None,
    timeout: float = 30.0,
) -> list[StreamResponse]:
    """The events of ``stream`` until one satisfies ``until`` (then the stream is closed) or
    the stream ends; fails the test after ``timeout`` seconds."""
    events: list[StreamResponse] = []

    async def consume() -> None:
        async for event in stream:
            events.append(event)
            if until is not None and until(event):
                return

    try:
        await asyncio.wait_for(consume(), timeout)
    except asyncio.TimeoutError:
        pytest.fail(f"the stream did not end within {timeout}s; it sent:\n{show(events)}", pytrace=False)
    finally:
        await cast(AsyncGenerator[StreamResponse, None], stream).aclose()
    return events


async def send(client: Client, message_request: SendMessageRequest) -> StreamResponse:
    """SendMessage's one answer (a client made with ``streaming=False``)."""
    [answer] = await read(client.send_message(message_request))
    return answer


async def start_task(client: Client, narrative: str, skill: str = "flow:complaint-flow", **kwargs: Any) -> Task:
    """A task of ``skill`` for a complaint with ``narrative``, as SendMessage returns it
    (``client`` non-streaming): without ``return_immediately`` it has ended or waits for
    input."""
    answer = await send(client, request(user_message(data_part(complaint(narrative)), skill=skill), **kwargs))
    assert kind(answer) == "task", f"SendMessage to {skill} answered a {kind(answer)}, not a task: {answer}"
    return answer.task


def waiting_for(task: Task, node: str) -> None:
    """Asserts ``task`` is INPUT_REQUIRED in human node ``node``."""
    assert task.status.state == TASK_STATE_INPUT_REQUIRED, f"task {task.id} is {TaskState.Name(task.status.state)}: {task}"
    data = [data_of(part) for part in task.status.message.parts if part.WhichOneof("content") == "data"]
    assert data and data[0].get("node") == node, f"task {task.id} waits in {data}, not in {node}"


def human_node(flow: Path, node: str) -> dict[str, Any]:
    """The definition of human node ``node`` in flow file ``flow``."""
    states: dict[str, Any] = yaml.safe_load(flow.read_text())["states"]
    found: dict[str, Any] = states[node]
    return found


async def reach_task(edge: EdgeProcess, task_id: str) -> dict[str, Any]:
    """``reach task get ID --json``: the task as Reach itself reports it."""
    result = await edge.cli("task", "get", task_id, "--json")
    assert result.returncode == 0, f"reach task get {task_id}: {result.stderr}"
    found: dict[str, Any] = json.loads(result.stdout)
    return found


# ---- discovery -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_the_mesh_card_lists_capabilities_and_flows_as_skills(edge: EdgeProcess) -> None:
    base = edge.a2a_url
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(f"{base}/.well-known/agent-card.json")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    card = response.json()
    assert card["name"] == "Reach mesh"
    assert card["supportedInterfaces"] == [
        {"url": f"{base}/", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"},
        {"url": edge.a2a_grpc, "protocolBinding": "GRPC", "protocolVersion": "1.0"},
    ]
    assert card["capabilities"]["streaming"] is True
    ids = [skill["id"] for skill in card["skills"]]
    assert ids == sorted(ids), f"skills not sorted by id: {ids}"
    assert EXPECTED_SKILLS <= set(ids), ids
    skills = {skill["id"]: skill for skill in card["skills"]}
    descriptions = yaml.safe_load(PROTOCOLS.read_text())["capabilities"]
    classify = skills["complaint.classify"]
    assert classify["description"] == descriptions["complaint.classify"]["description"], classify
    assert "complaint" in classify["tags"], classify
    assert skills["flow:complaint-flow"]["name"], skills["flow:complaint-flow"]

    # a2a-sdk reads the same card.
    parsed = await fetch_card(edge)
    assert parsed.name == "Reach mesh"
    assert [skill.id for skill in parsed.skills] == ids
    assert [(i.protocol_binding, i.url) for i in parsed.supported_interfaces] == [
        ("JSONRPC", f"{base}/"),
        ("GRPC", edge.a2a_grpc),
    ]

    # GetExtendedAgentCard (over gRPC, which the SDK's client would not ask without the
    # capability) returns the same card.
    async with grpc.aio.insecure_channel(edge.a2a_grpc) as channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)  # type: ignore[no-untyped-call]
        extended = await stub.GetExtendedAgentCard(
            GetExtendedAgentCardRequest(), metadata=(("a2a-version", "1.0"),), timeout=10
        )
    assert extended.name == "Reach mesh"
    assert [skill.id for skill in extended.skills] == ids


@pytest.mark.timeout(60)
async def test_each_service_has_a_card_of_its_own(edge: EdgeProcess) -> None:
    instances = await edge.instances()
    serving = {c.name: i.spec.service for i in instances for c in i.spec.capabilities}
    service = serving["complaint.classify"]
    capabilities = sorted({c.name for i in instances if i.spec.service == service for c in i.spec.capabilities})

    card = await fetch_card(edge, f"/agents/{service}")
    assert sorted(skill.id for skill in card.skills) == capabilities, card
    interfaces = {i.protocol_binding: i for i in card.supported_interfaces}
    assert interfaces["JSONRPC"].url == f"{edge.a2a_url}/agents/{service}/", card
    assert interfaces["GRPC"].url == edge.a2a_grpc, card
    assert interfaces["GRPC"].tenant == service, card

    async with httpx.AsyncClient(timeout=10) as http:
        missing = await http.get(f"{edge.a2a_url}/agents/no-such-service/.well-known/agent-card.json")
    assert missing.status_code == 404, missing.text


# ---- messages to capabilities ----------------------------------------------------------------


@BINDINGS
@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "streaming"])
@pytest.mark.timeout(60)
async def test_a_message_to_a_capability_gets_its_reply(edge: EdgeProcess, binding: str, streaming: bool) -> None:
    card = await fetch_card(edge)
    async with connect(card, binding, streaming=streaming) as client:
        # The skill in the message's metadata...
        events = await read(
            client.send_message(request(user_message(data_part(complaint(CONFIDENT)), skill="complaint.classify")))
        )
        # ... or in the request's.
        events += await read(
            client.send_message(request(user_message(data_part(complaint(CONFIDENT))), skill="complaint.classify"))
        )
    assert [kind(event) for event in events] == ["message", "message"], show(events)
    for event in events:
        reply = event.message
        assert reply.role == ROLE_AGENT, reply
        [part] = [part for part in reply.parts if part.WhichOneof("content") == "data"]
        classification = data_of(part)
        assert classification["category"] == "servicing", classification
        assert classification["confidence"] >= 0.5, classification
        assert classification["capability"] == "complaint.servicing", classification


@BINDINGS
@pytest.mark.timeout(60)
async def test_a_message_needs_a_skill_unless_its_agent_has_one(edge: EdgeProcess, binding: str) -> None:
    async with connect(await fetch_card(edge), binding, streaming=False) as client:
        with pytest.raises(InvalidParamsError):
            await send(client, request(user_message(data_part(complaint(CONFIDENT)))))

    # executor.servicing serves one capability: its card's agent needs no skill.
    card = await fetch_card(edge, "/agents/executor.servicing")
    assert [skill.id for skill in card.skills] == ["complaint.servicing"]
    async with connect(card, binding, streaming=False) as client:
        answer = await send(client, request(user_message(data_part(complaint(CONFIDENT)))))
    assert kind(answer) == "message", answer
    [part] = [part for part in answer.message.parts if part.WhichOneof("content") == "data"]
    assert data_of(part)["department"], answer


@BINDINGS
@pytest.mark.timeout(60)
async def test_a_message_to_a_skill_the_card_does_not_list_is_invalid_params(edge: EdgeProcess, binding: str) -> None:
    """The skill is the client's parameter: one the card does not list is INVALID_PARAMS
    (JSON-RPC -32602, gRPC INVALID_ARGUMENT with ErrorInfo INVALID_PARAMS), as a missing one is."""
    async with connect(await fetch_card(edge), binding, streaming=False) as client:
        with pytest.raises(InvalidParamsError):
            await send(client, request(user_message(data_part(complaint(CONFIDENT)), skill="no.such.skill")))
        with pytest.raises(InvalidParamsError):
            await send(client, request(user_message(data_part(complaint(CONFIDENT)), skill="flow:no-such-flow")))


# ---- flow tasks ------------------------------------------------------------------------------


@BINDINGS
@pytest.mark.timeout(90)
async def test_a_flow_task_streams_until_it_needs_input_then_resumes(edge: EdgeProcess, binding: str) -> None:
    card = await fetch_card(edge)
    review = human_node(COMPLAINT_FLOW, "human_review")
    async with connect(card, binding) as client:
        events = await read(
            client.send_message(request(user_message(data_part(complaint(VAGUE)), skill="flow:complaint-flow"))),
            until=lambda event: state(event) == TASK_STATE_INPUT_REQUIRED,
        )
        trace = show(events)
        assert kind(events[0]) == "task", trace
        task_id = events[0].task.id
        assert task_id, trace
        updates = events[1:]
        assert all(kind(event) in ("status_update", "artifact_update") for event in updates), trace
        assert all(getattr(event, kind(event)).task_id == task_id for event in updates), trace
        sequences = [sequence(event) for event in events]
        assert all(a < b for a, b in zip(sequences[1:], sequences[2:])), f"sequences not increasing: {sequences}\n{trace}"
        assert sequences[0] < sequences[1], f"the snapshot reflects a later event than the first update:\n{trace}"

        [classified] = [event.artifact_update.artifact for event in updates if kind(event) == "artifact_update"]
        assert classified.artifact_id == "classify", trace
        [part] = classified.parts
        assert data_of(part)["confidence"] < 0.5, classified

        last = events[-1]
        assert kind(last) == "status_update" and last.status_update.status.state == TASK_STATE_INPUT_REQUIRED, trace
        asked = last.status_update.status.message
        assert asked.role == ROLE_AGENT, asked
        texts = [part.text for part in asked.parts if part.WhichOneof("content") == "text"]
        data = [data_of(part) for part in asked.parts if part.WhichOneof("content") == "data"]
        assert texts == [review["prompt"]], asked
        assert data == [{"node": "human_review", "inputSchema": review["schema"]}], asked

        # The person's answer: a message naming the task.
        resumed = await read(
            client.send_message(request(user_message(data_part({"category": "servicing"}), task_id=task_id))),
            until=lambda event: state(event) in TERMINAL,
        )
        assert resumed and state(resumed[-1]) == TASK_STATE_COMPLETED, show(resumed)

        done = await client.get_task(GetTaskRequest(id=task_id))
        assert done.status.state == TASK_STATE_COMPLETED, done
        # human_review goes straight to `done`: the classification is the only task node.
        assert [artifact.artifact_id for artifact in done.artifacts] == ["classify"], done
        bare = await client.get_task(GetTaskRequest(id=task_id, history_length=0))
        assert len(bare.history) == 0, bare
        one = await client.get_task(GetTaskRequest(id=task_id, history_length=1))
        assert len(one.history) <= 1, one

    reach = await reach_task(edge, task_id)
    assert reach["status"] == "SUCCEEDED", reach
    [human] = [node for node in reach["nodes"] if node["node_id"] == "human_review"]
    assert human["output"] == {"category": "servicing"}, human

    # The stream's first event is the task as it was submitted.
    assert events[0].task.status.state == TASK_STATE_SUBMITTED, f"the first event is not a SUBMITTED task:\n{trace}"


@BINDINGS
@pytest.mark.timeout(90)
async def test_a_confident_complaint_runs_to_its_executor(edge: EdgeProcess, binding: str) -> None:
    async with connect(await fetch_card(edge), binding, streaming=False) as client:
        task = await start_task(client, CONFIDENT)
        assert task.status.state == TASK_STATE_COMPLETED, task
        artifacts = {artifact.artifact_id: artifact for artifact in task.artifacts}
        assert sorted(artifacts) == ["classify", "servicing"], task
        assert data_of(artifacts["classify"].parts[0])["category"] == "servicing", task
        assert data_of(artifacts["servicing"].parts[0])["department"], task

        # historyLength 0: the task without its history.
        bare = await start_task(client, CONFIDENT, history_length=0)
        assert bare.status.state == TASK_STATE_COMPLETED and len(bare.history) == 0, bare

        # With returnImmediately SendMessage answers before the task has run.
        early = await start_task(client, CONFIDENT, return_immediately=True)
        assert early.status.state in (TASK_STATE_SUBMITTED, TASK_STATE_WORKING), early

        async def finished() -> Task | None:
            found = await client.get_task(GetTaskRequest(id=early.id))
            return found if found.status.state in TERMINAL else None

        ended: Task = await eventually(finished, f"task {early.id} ending", timeout=30, every=0.1)
        assert ended.status.state == TASK_STATE_COMPLETED, ended


@BINDINGS
@pytest.mark.timeout(90)
async def test_an_answer_the_schema_refuses_leaves_the_task_waiting(edge: EdgeProcess, binding: str) -> None:
    async with connect(await fetch_card(edge), binding, streaming=False) as client:
        task = await start_task(client, VAGUE)
        waiting_for(task, "human_review")

        with pytest.raises(InvalidParamsError) as refused:
            await send(client, request(user_message(data_part({"category": "nope"}), task_id=task.id)))
        assert "/category" in refused.value.message, refused.value

        still = await client.get_task(GetTaskRequest(id=task.id))
        waiting_for(still, "human_review")

        # A good answer still resumes it.
        answer = await send(client, request(user_message(data_part({"category": "repayment"}), task_id=task.id)))
        assert kind(answer) == "task" and answer.task.status.state == TASK_STATE_COMPLETED, answer

        # Now it waits for nothing: another answer is refused, and so is one to no task.
        with pytest.raises(UnsupportedOperationError):
            await send(client, request(user_message(data_part({"category": "servicing"}), task_id=task.id)))
        with pytest.raises(TaskNotFoundError):
            await send(client, request(user_message(data_part({"category": "servicing"}), task_id=str(uuid.uuid4()))))


@BINDINGS
@pytest.mark.parametrize(
    "skill, node, reach_status",
    [
        ("flow:complaint-flow", "human_review", "FAILED"),
        ("flow:a2a-two-reviews", "first_review", "CANCELLED"),
    ],
    ids=["with-on-cancel", "without-on-cancel"],
)
@pytest.mark.timeout(90)
async def test_a_task_waiting_for_input_can_be_cancelled_once(
    edge: EdgeProcess, binding: str, skill: str, node: str, reach_status: str
) -> None:
    """complaint-flow's human_review has an ``on_cancel`` node (a ``fail`` node, so the Reach
    task ends FAILED there); a2a-two-reviews' first_review has none (the Reach task ends
    CANCELLED). Either way the A2A task ends CANCELED: the client cancelled it."""
    async with connect(await fetch_card(edge), binding, streaming=False) as client:
        task = await start_task(client, VAGUE, skill=skill)
        waiting_for(task, node)

        cancelled = await client.cancel_task(CancelTaskRequest(id=task.id))
        assert cancelled.id == task.id

        async def ended() -> Task | None:
            found = await client.get_task(GetTaskRequest(id=task.id))
            return found if found.status.state in TERMINAL else None

        final: Task = await eventually(ended, f"task {task.id} ending after CancelTask", timeout=30, every=0.05)

        # It has ended: it cannot be cancelled again.
        with pytest.raises(TaskNotCancelableError):
            await client.cancel_task(CancelTaskRequest(id=task.id))
        with pytest.raises(TaskNotFoundError):
            await client.cancel_task(CancelTaskRequest(id=str(uuid.uuid4())))

    reach = await reach_task(edge, task.id)
    # CancelTask answers the cancelled task (as a2a-sdk's own server does: it refuses a
    # cancellation whose result is not CANCELED), the task stays CANCELED, and Reach has it
    # as the flow's cancel path left it.
    found = {
        "CancelTask's answer": TaskState.Name(cancelled.status.state),
        "the task once ended (GetTask)": TaskState.Name(final.status.state),
        "reach task get": reach["status"],
    }
    assert found == {
        "CancelTask's answer": "TASK_STATE_CANCELED",
        "the task once ended (GetTask)": "TASK_STATE_CANCELED",
        "reach task get": reach_status,
    }, f"{found}; reach task get: error {reach.get('error')!r}, nodes {[(n['node_id'], n['status']) for n in reach['nodes']]}"


@BINDINGS
@pytest.mark.timeout(60)
async def test_a_flow_task_of_text_alone_has_the_text_as_input(edge: EdgeProcess, binding: str) -> None:
    async with connect(await fetch_card(edge), binding, streaming=False) as client:
        answer = await send(
            client,
            request(
                user_message(text_part("my loan servicer lost my payment"), skill="flow:complaint-flow"),
                return_immediately=True,
            ),
        )
    assert kind(answer) == "task", answer
    reach = await reach_task(edge, answer.task.id)
    assert reach["input"] == {"text": "my loan servicer lost my payment"}, reach


# ---- resumable streams -----------------------------------------------------------------------


@BINDINGS
@pytest.mark.timeout(120)
async def test_a_dropped_subscription_resumes_after_its_last_event(edge: EdgeProcess, binding: str) -> None:
    card = await fetch_card(edge)
    async with connect(card, binding, streaming=False) as client:
        task = await start_task(client, CONFIDENT, skill="flow:a2a-two-reviews")
    waiting_for(task, "first_review")

    def at_second_review(event: StreamResponse) -> bool:
        if kind(event) != "status_update" or event.status_update.status.state != TASK_STATE_INPUT_REQUIRED:
            return False
        data = [data_of(part) for part in event.status_update.status.message.parts if part.WhichOneof("content") == "data"]
        return bool(data) and data[0].get("node") == "second_review"

    # A subscriber that stays connected throughout, and one whose connection drops after the
    # task snapshot.
    async with connect(card, binding) as witness_client:
        witness_stream = witness_client.subscribe(SubscribeToTaskRequest(id=task.id))
        first = await asyncio.wait_for(anext(witness_stream), 30)
        assert kind(first) == "task" and first.task.id == task.id, first
        witness = asyncio.create_task(read(witness_stream, until=at_second_review))

        async with connect(card, binding) as dropped_client:
            dropped_stream = dropped_client.subscribe(SubscribeToTaskRequest(id=task.id))
            snapshot = await asyncio.wait_for(anext(dropped_stream), 30)
            await cast(AsyncGenerator[StreamResponse, None], dropped_stream).aclose()
        # (closing the client closed its connection)
        assert kind(snapshot) == "task" and snapshot.task.status.state == TASK_STATE_INPUT_REQUIRED, snapshot
        last_seen = sequence(snapshot)

        # The task advances while nobody listens on that connection.
        async with connect(card, binding, streaming=False) as client:
            answer = await send(client, request(user_message(data_part({"approve": True}), task_id=task.id)))
        assert kind(answer) == "task", answer
        waiting_for(answer.task, "second_review")
        live = await asyncio.wait_for(witness, 30)

        async with connect(card, binding) as again:
            resumed = await read(
                again.subscribe(
                    SubscribeToTaskRequest(id=task.id),
                    context=ClientCallContext(service_parameters={"Last-Event-ID": str(last_seen)}),
                ),
                until=at_second_review,
            )
            everything = await read(
                again.subscribe(
                    SubscribeToTaskRequest(id=task.id),
                    context=ClientCallContext(service_parameters={"Last-Event-ID": "0"}),
                ),
                until=at_second_review,
            )

    trace = f"resumed after {last_seen}:\n{show(resumed)}\nfrom 0:\n{show(everything)}\nlive:\n{show(live)}"
    assert kind(resumed[0]) == "task" and resumed[0].task.id == task.id, trace
    waiting_for(resumed[0].task, "second_review")
    missed = resumed[1:]
    assert missed, trace
    sequences = [sequence(event) for event in missed]
    assert all(s > last_seen for s in sequences), trace
    assert sequences == sorted(set(sequences)), f"duplicates or disorder:\n{trace}"
    artifacts = [event.artifact_update.artifact.artifact_id for event in missed if kind(event) == "artifact_update"]
    assert artifacts == ["classify"], trace

    def as_dicts(events: list[StreamResponse]) -> list[dict[str, Any]]:
        return [json_format.MessageToDict(event) for event in events]

    # Exactly what the connection that never dropped got.
    assert as_dicts(missed) == as_dicts([event for event in live if sequence(event) > last_seen]), trace

    # Finish the task: a finished task has nothing to subscribe to.
    async with connect(card, binding, streaming=False) as client:
        answer = await send(client, request(user_message(data_part({"ok": True}), task_id=task.id)))
        assert kind(answer) == "task" and answer.task.status.state == TASK_STATE_COMPLETED, answer
    async with connect(card, binding) as client:
        with pytest.raises(UnsupportedOperationError):
            await read(client.subscribe(SubscribeToTaskRequest(id=task.id)))

    # A replay from the start has the same events after that sequence.
    assert kind(everything[0]) == "task", trace
    # Last-Event-ID 0 asks for every event after sequence 0: a replay does not stop at a wait
    # the task has long left (only the task's current state may end the stream).
    assert at_second_review(everything[-1]), f"the replay from 0 ended before the task's current state:\n{trace}"
    replay = everything[1:]
    assert [sequence(event) for event in replay] == sorted({sequence(event) for event in replay}), trace
    assert as_dicts(missed) == as_dicts([event for event in replay if sequence(event) > last_seen]), trace
    # The replay from 0 holds the task's whole story: the first wait as well.
    assert any(state(event) == TASK_STATE_INPUT_REQUIRED for event in replay if sequence(event) <= last_seen), trace


# ---- protocol versions -----------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_an_unsupported_a2a_version_is_refused(edge: EdgeProcess) -> None:
    unknown = str(uuid.uuid4())
    body = {"jsonrpc": "2.0", "id": "1", "method": "GetTask", "params": {"id": unknown}}
    async with httpx.AsyncClient(timeout=10) as http:
        for version in ("0.3", "2.0"):
            response = await http.post(f"{edge.a2a_url}/", json=body, headers={"A2A-Version": version})
            error = response.json().get("error")
            assert error and error["code"] == -32009, f"A2A-Version {version}: {response.status_code} {response.text}"
        for accepted in (None, "1.0", "1.1"):
            headers = {"A2A-Version": accepted} if accepted else {}
            response = await http.post(f"{edge.a2a_url}/", json=body, headers=headers)
            error = response.json().get("error")
            assert error and error["code"] == -32001, f"A2A-Version {accepted}: {response.status_code} {response.text}"

    async with grpc.aio.insecure_channel(edge.a2a_grpc) as channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)  # type: ignore[no-untyped-call]
        for version in ("0.3", "2.0"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetTask(GetTaskRequest(id=unknown), metadata=(("a2a-version", version),), timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value
            status = rpc_status.from_call(cast(grpc.Call, refused.value))
            assert status is not None, f"a2a-version {version}: no google.rpc.Status in {refused.value}"
            infos = []
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    infos.append((info.domain, info.reason))
            assert infos == [("a2a-protocol.org", "VERSION_NOT_SUPPORTED")], status
        for accepted_metadata in ((), (("a2a-version", "1.0"),)):
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.GetTask(GetTaskRequest(id=unknown), metadata=accepted_metadata, timeout=10)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND, missing.value


# ---- GetTask / ListTasks ---------------------------------------------------------------------


@BINDINGS
@pytest.mark.timeout(90)
async def test_tasks_are_listed_by_context_and_status(edge: EdgeProcess, binding: str) -> None:
    async with connect(await fetch_card(edge), binding, streaming=False) as client:
        first = await start_task(client, VAGUE)
        second = await start_task(client, VAGUE)
        done = await start_task(client, CONFIDENT)
        assert done.status.state == TASK_STATE_COMPLETED, done
        for task in (first, second):
            assert task.context_id, task
            waiting_for(task, "human_review")

        got = await client.get_task(GetTaskRequest(id=first.id))
        assert got.id == first.id and got.context_id == first.context_id, got
        waiting_for(got, "human_review")
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id=str(uuid.uuid4())))

        by_context = await client.list_tasks(ListTasksRequest(context_id=first.context_id))
        assert first.id in {task.id for task in by_context.tasks}, by_context
        assert all(task.context_id == first.context_id for task in by_context.tasks), by_context

        waiting = await client.list_tasks(ListTasksRequest(status=TASK_STATE_INPUT_REQUIRED, page_size=100))
        assert all(task.status.state == TASK_STATE_INPUT_REQUIRED for task in waiting.tasks), waiting
        completed = await client.list_tasks(ListTasksRequest(status=TASK_STATE_COMPLETED, page_size=100))
        assert all(task.status.state == TASK_STATE_COMPLETED for task in completed.tasks), completed
        assert done.id in {task.id for task in completed.tasks}, completed
        assert done.id not in {task.id for task in waiting.tasks}, waiting

        # One task a page: every waiting task once, both of this test's among them.
        seen: list[str] = []
        token = ""
        for _ in range(500):
            page = await client.list_tasks(
                ListTasksRequest(status=TASK_STATE_INPUT_REQUIRED, page_size=1, page_token=token)
            )
            assert len(page.tasks) <= 1, page
            seen += [task.id for task in page.tasks]
            token = page.next_page_token
            if not token:
                break
        assert len(seen) == len(set(seen)), f"a task on two pages: {seen}"
        assert {first.id, second.id} <= set(seen), seen

        # A message with the contextId of an earlier task starts its task in that context (as
        # a2a-sdk's own server does: RequestContext keeps the contextId the request gives).
        answer = await send(
            client,
            request(user_message(data_part(complaint(VAGUE)), skill="flow:complaint-flow", context_id=first.context_id)),
        )
        assert kind(answer) == "task", answer
        assert answer.task.context_id == first.context_id, (
            f"the task of a message in context {first.context_id} has context {answer.task.context_id}"
        )
        both = await client.list_tasks(ListTasksRequest(context_id=first.context_id))
        assert sorted(task.id for task in both.tasks) == sorted([first.id, answer.task.id]), both


# ---- without the HTTP port -------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_without_the_edge_http_port_a2a_is_served_over_grpc(processes: Callable[..., ReachProcess], workdir: Path) -> None:
    """``--edge-listen ""`` disables the edge's HTTP port (no ``a2a`` banner line, no JSON-RPC
    interface on the card); A2A over gRPC stays on the mesh's port."""
    dev = processes(
        "dev", "--listen", "127.0.0.1:0", "--admin-listen", "", "--edge-listen", "", "--no-agents",
        "--data-dir", str(workdir / "data"),
    )
    await dev.wait_serving()
    async with grpc.aio.insecure_channel(dev.address) as channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)  # type: ignore[no-untyped-call]
        card = await stub.GetExtendedAgentCard(GetExtendedAgentCardRequest(), metadata=(("a2a-version", "1.0"),), timeout=10)
        assert card.name == "Reach mesh", card
        bindings = [(i.protocol_binding, i.url) for i in card.supported_interfaces]
        assert bindings == [("GRPC", dev.address)], bindings
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.GetTask(GetTaskRequest(id=str(uuid.uuid4())), metadata=(("a2a-version", "1.0"),), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND, missing.value
    assert dev.process.stdout is not None
    rest = dev.process.stdout.read() or b""
    assert b"a2a " not in rest, rest


# ---- the documented example, and the edge on its own ------------------------------------------


@BINDINGS
@pytest.mark.timeout(90)
async def test_the_documented_example_client_runs(edge: EdgeProcess, binding: str) -> None:
    """``sdk/python/examples/a2a_client.py`` (docs/edges.md) against the mesh: a capability's
    answer, a flow task that waits for a person, and the reviewer's answer that completes it."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPO / "sdk/python/examples/a2a_client.py"),
        "--edge",
        edge.a2a_url,
        "--binding",
        binding,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(child.communicate(), timeout=60)
    text = out.decode(errors="replace")
    assert child.returncode == 0, text
    assert "skill flow:complaint-flow" in text, text
    assert re.search(r"complaint\.classify answered: .*'category': 'servicing'", text), text
    assert "status TASK_STATE_INPUT_REQUIRED" in text and "the flow asks: Classify this complaint" in text, text
    assert text.rstrip().endswith("status TASK_STATE_COMPLETED"), text


@pytest.mark.timeout(90)
async def test_reach_edge_serves_a2a_for_a_mesh_elsewhere(edge: EdgeProcess, workdir: Path) -> None:
    """``reach edge`` alone, pointed at the module's mesh: its own card (its own URLs) with the
    mesh's skills, and a message to a capability answered through that mesh's router."""
    mesh = edge.endpoint
    alone = EdgeProcess(
        [
            "edge", "--listen", "127.0.0.1:0", "--admin-listen", "", "--edge-listen", "127.0.0.1:0",
            "--registry", mesh, "--router", mesh, "--orchestrator", mesh,
        ],
        cwd=workdir,
    )
    try:
        assert alone.a2a_url != edge.a2a_url
        async with httpx.AsyncClient(timeout=10) as http:
            card = await A2ACardResolver(http, alone.a2a_url).get_agent_card()
        assert {"complaint.classify", "flow:complaint-flow"} <= {s.id for s in card.skills}
        assert card.supported_interfaces[0].url == f"{alone.a2a_url}/"
        assert card.supported_interfaces[1].url == alone.a2a_grpc
        async with connect(card, "JSONRPC", streaming=False) as client:
            complaint = {"complaint_id": "edge-alone-1", "narrative": CONFIDENT}
            answer = await send(client, request(user_message(data_part(complaint), skill="complaint.classify")))
        assert kind(answer) == "message", answer
        assert data_of(answer.message.parts[0])["category"] == "servicing", answer
    finally:
        alone.stop()


# ---- push notifications ----------------------------------------------------------------------


class Webhook:
    """An HTTP receiver on 127.0.0.1 that records every POST (its JSON body and headers) and
    answers 503 to the first :attr:`refuse` of them, as a webhook that is down would."""

    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.refused = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if hook.refused < hook.refuse:
                    hook.refused += 1
                    self.send_response(503)
                else:
                    hook.bodies.append(json.loads(body))
                    hook.headers.append({k.lower(): v for k, v in self.headers.items()})
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def states(self) -> list[str]:
        return [b["statusUpdate"]["status"]["state"] for b in self.bodies if "statusUpdate" in b]


@BINDINGS
@pytest.mark.timeout(90)
async def test_push_notifications_reach_a_webhook_that_was_down_in_order_once(edge: EdgeProcess, binding: str) -> None:
    """A push config made with the task (SendMessageConfiguration) and one made later: each
    webhook gets every update of the task, in order, exactly once, with its token — also the
    one that refused the first deliveries (the orchestrator retries from its durable log)."""
    early, late = Webhook(), Webhook(refuse=2)
    try:
        async with connect(await fetch_card(edge), binding, streaming=False) as client:
            first = request(user_message(data_part(complaint(VAGUE)), skill="flow:complaint-flow"))
            first.configuration.task_push_notification_config.CopyFrom(
                TaskPushNotificationConfig(url=early.url, token="early-token")
            )
            answer = await send(client, first)
            assert kind(answer) == "task", answer
            task = answer.task
            waiting_for(task, "human_review")

            made = await client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=task.id, id="late", url=late.url, token="late-token")
            )
            assert (made.id, made.task_id, made.url) == ("late", task.id, late.url), made
            found = await client.get_task_push_notification_config(
                GetTaskPushNotificationConfigRequest(task_id=task.id, id="late")
            )
            assert found.url == late.url, found
            listed = await client.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=task.id)
            )
            assert {c.url for c in listed.configs} == {early.url, late.url}, listed
            with pytest.raises(TaskNotFoundError):
                await client.get_task_push_notification_config(
                    GetTaskPushNotificationConfigRequest(task_id=task.id, id="nobody")
                )

            done = await send(client, request(user_message(data_part({"category": "servicing"}), task_id=task.id)))
            assert kind(done) == "task" and done.task.status.state == TASK_STATE_COMPLETED, done

            def delivered(hook: Webhook) -> bool:
                return bool(hook.states()) and hook.states()[-1] == "TASK_STATE_COMPLETED"

            await eventually(lambda: delivered(early) and delivered(late), "both webhooks got the completion", timeout=30)
            assert late.refused == 2
            for hook, token in [(early, "early-token"), (late, "late-token")]:
                assert hook.bodies == early.bodies, "both webhooks get the same notifications"
                sequences = [next(iter(b.values()))["metadata"]["reach.sequence"] for b in hook.bodies]
                assert sequences == sorted(sequences), sequences
                # Exactly once: no (event, notification kind) twice, although the late one
                # was refused and retried.
                keys = [(seq, next(iter(b))) for seq, b in zip(sequences, hook.bodies)]
                assert len(keys) == len(set(keys)), keys
                assert all(h.get("x-a2a-notification-token") == token for h in hook.headers), hook.headers
                assert all(next(iter(b.values()))["taskId"] == task.id for b in hook.bodies)
            states = early.states()
            assert states[0] == "TASK_STATE_SUBMITTED" and "TASK_STATE_INPUT_REQUIRED" in states, states
            artifacts = [b["artifactUpdate"]["artifact"]["artifactId"] for b in early.bodies if "artifactUpdate" in b]
            assert artifacts == ["classify"], early.bodies

            await client.delete_task_push_notification_config(
                DeleteTaskPushNotificationConfigRequest(task_id=task.id, id="late")
            )
            listed = await client.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=task.id)
            )
            assert [c.url for c in listed.configs] == [early.url], listed
    finally:
        early.close()
        late.close()


@BINDINGS
@pytest.mark.timeout(60)
async def test_a_push_config_to_an_internal_address_is_invalid_params(edge: EdgeProcess, binding: str) -> None:
    """A push notification URL is the caller's input: one that points the orchestrator at a
    cloud metadata endpoint or a private network is refused (server-side request forgery),
    saying which setting would allow it. ``reach dev`` allows loopback only."""
    async with connect(await fetch_card(edge), binding, streaming=False) as client:
        task = await start_task(client, VAGUE)
        for url in ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1:8080/hook", "http://[fd00::1]/hook"]:
            with pytest.raises(InvalidParamsError) as refused:
                await client.create_task_push_notification_config(
                    TaskPushNotificationConfig(task_id=task.id, id="internal", url=url)
                )
            assert "webhooks may not reach" in refused.value.message, refused.value
            assert "orchestrator.webhook_allowed_networks" in refused.value.message, refused.value
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task.id)
        )
        assert list(listed.configs) == [], listed


@pytest.mark.timeout(60)
async def test_a_callers_traceparent_is_the_trace_of_its_call_and_its_task(edge: EdgeProcess) -> None:
    """A caller that is part of a trace (W3C ``traceparent``) has the capability call and the
    flow task it starts continue that trace: one trace from the A2A client through the mesh."""
    trace_id = uuid.uuid4().hex
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01", "A2A-Version": "1.0"}

    def rpc(skill: str) -> dict[str, Any]:
        return {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "SendMessage",
            "params": {
                "message": {
                    "messageId": str(uuid.uuid4()),
                    "role": "ROLE_USER",
                    "metadata": {"skill": skill},
                    "parts": [{"data": complaint(CONFIDENT)}],
                },
                "configuration": {"returnImmediately": True},
            },
        }

    async with httpx.AsyncClient(timeout=30) as http:
        call = (await http.post(f"{edge.a2a_url}/", json=rpc("complaint.classify"), headers=headers)).json()
        task = (await http.post(f"{edge.a2a_url}/", json=rpc("flow:complaint-flow"), headers=headers)).json()
    assert call["result"]["message"]["metadata"]["reach.traceId"] == trace_id, call
    assert task["result"]["task"]["metadata"]["reach.traceId"] == trace_id, task
    reach = await reach_task(edge, task["result"]["task"]["id"])
    assert reach["trace_id"] == trace_id, reach


async def test_browsers_and_rebound_names_cannot_call_the_mesh(edge: EdgeProcess) -> None:
    """A web page can make a browser POST to the edge (a ``text/plain`` request needs no CORS
    preflight) or rebind a name it owns to 127.0.0.1: neither reaches a capability. The cards
    stay readable from anywhere."""
    send = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {
            "message": {
                "messageId": str(uuid.uuid4()),
                "role": "ROLE_USER",
                "metadata": {"skill": "complaint.classify"},
                "parts": [{"data": {"complaint_id": "csrf", "narrative": CONFIDENT}}],
            }
        },
    }
    body = json.dumps(send)
    json_type = {"content-type": "application/json", "A2A-Version": "1.0"}
    async with httpx.AsyncClient(timeout=30) as http:
        served = await http.post(edge.a2a_url + "/", content=body, headers=json_type)
        cross_site = await http.post(
            edge.a2a_url + "/", content=body, headers={"content-type": "text/plain", "origin": "https://evil.example.com"}
        )
        same_with_json = await http.post(edge.a2a_url + "/", content=body, headers={**json_type, "origin": "https://evil.example.com"})
        plain_text = await http.post(edge.a2a_url + "/", content=body, headers={"content-type": "text/plain"})
        rebound = await http.post(edge.a2a_url + "/", content=body, headers={**json_type, "host": "evil.example.com"})
        card = await http.get(edge.a2a_url + "/.well-known/agent-card.json", headers={"origin": "https://evil.example.com"})
    assert served.status_code == 200 and "result" in served.json(), served.text
    assert cross_site.status_code == 403, cross_site.text
    assert "edge.allowed_origins" in cross_site.text
    assert same_with_json.status_code == 403, same_with_json.text
    assert plain_text.status_code == 415, plain_text.text
    assert rebound.status_code == 403, rebound.text
    assert "edge.allowed_hosts" in rebound.text
    assert card.status_code == 200
