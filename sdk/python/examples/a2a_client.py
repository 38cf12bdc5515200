"""An A2A client of the Reach mesh, written with the official A2A SDK (``a2a-sdk``) alone — it
knows nothing of Reach. Against ``reach dev`` (docs/edges.md):

    .venv/bin/python sdk/python/examples/a2a_client.py                       # JSON-RPC
    .venv/bin/python sdk/python/examples/a2a_client.py --binding GRPC        # gRPC

It discovers the mesh's agent card, asks the `complaint.classify` skill about one complaint,
then runs a vague complaint through the `flow:complaint-flow` skill: the task streams until
the flow's human step makes it INPUT_REQUIRED, and a second message with the task id answers
the step, as a reviewer would.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from typing import Any

import grpc
import httpx
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import (
    ROLE_USER,
    TASK_STATE_INPUT_REQUIRED,
    Message,
    Part,
    SendMessageRequest,
    TaskState,
)
from google.protobuf import json_format, struct_pb2


def message(data: dict[str, Any], *, skill: str = "", task_id: str = "") -> Message:
    """A user message with one data part, naming the skill it is for (or the task it answers)."""
    part = Part()
    part.data.CopyFrom(json_format.ParseDict(data, struct_pb2.Value()))
    msg = Message(message_id=str(uuid.uuid4()), role=ROLE_USER, parts=[part], task_id=task_id)
    if skill:
        msg.metadata.update({"skill": skill})
    return msg


def data_of(parts: Any) -> list[Any]:
    return [json_format.MessageToDict(p.data) for p in parts if p.WhichOneof("content") == "data"]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edge", default="http://127.0.0.1:7072", help="the edge's HTTP base URL (the card's host)")
    parser.add_argument("--binding", default="JSONRPC", choices=["JSONRPC", "GRPC"])
    args = parser.parse_args()

    async with httpx.AsyncClient(timeout=60) as http:
        card = await A2ACardResolver(http, args.edge).get_agent_card()
        print(f"agent: {card.name}: {len(card.skills)} skills")
        for skill in card.skills:
            print(f"  skill {skill.id}: {skill.description}")

        config = ClientConfig(
            supported_protocol_bindings=[args.binding],
            httpx_client=http,
            grpc_channel_factory=lambda url: grpc.aio.insecure_channel(url),
        )
        client = ClientFactory(config).create(card)

        # A capability: the answer is a message carrying the agent's reply.
        complaint = {"complaint_id": "a2a-1", "narrative": "I was charged a late fee although my autopay was set up"}
        async for event in client.send_message(SendMessageRequest(message=message(complaint, skill="complaint.classify"))):
            if event.HasField("message"):
                print(f"complaint.classify answered: {data_of(event.message.parts)[0]}")

        # A flow: a task, streamed until the human step needs an answer.
        vague = {"complaint_id": "a2a-2", "narrative": "I am not happy with this."}
        task_id = ""
        async for event in client.send_message(SendMessageRequest(message=message(vague, skill="flow:complaint-flow"))):
            if event.HasField("task"):
                task_id = event.task.id
                print(f"task {task_id}: {TaskState.Name(event.task.status.state)}")
            elif event.HasField("status_update"):
                status = event.status_update.status
                print(f"  status {TaskState.Name(status.state)}")
                if status.state == TASK_STATE_INPUT_REQUIRED:
                    prompt = [p.text for p in status.message.parts if p.WhichOneof("content") == "text"]
                    print(f"  the flow asks: {prompt[0] if prompt else '(no prompt)'}")
            elif event.HasField("artifact_update"):
                artifact = event.artifact_update.artifact
                print(f"  artifact {artifact.artifact_id}: {data_of(artifact.parts)[0]}")

        # The reviewer's answer resumes the human step, validated against its schema.
        answer = message({"category": "servicing", "note": "late fee dispute"}, task_id=task_id)
        async for event in client.send_message(SendMessageRequest(message=answer)):
            if event.HasField("status_update"):
                print(f"  status {TaskState.Name(event.status_update.status.state)}")
            elif event.HasField("task"):
                print(f"task {task_id}: {TaskState.Name(event.task.status.state)}")
        await client.close()


if __name__ == "__main__":
    asyncio.run(main())
