"""The Reach Python SDK: agents and clients of the Reach agent mesh.

An agent is a process that serves ``reach.v1.AgentService`` and registers its capabilities
with the registry; :class:`AgentRuntime` does all of that around your handlers. A caller
addresses capabilities through the router; :class:`MeshClient` does that, and starts and
follows orchestrator tasks. Both behave on the wire as the Rust SDK (``reach-sdk``) does::

    import asyncio
    from reach_mesh import AgentConfig, AgentRuntime, HandlerContext, Message, data_part

    runtime = AgentRuntime(AgentConfig(service="greeter", registry_endpoint="http://127.0.0.1:7070"))

    @runtime.handler("greet", "1.0.0", description="greets a person by name",
                     input_schema={"type": "object", "required": ["name"],
                                   "properties": {"name": {"type": "string"}}})
    async def greet(ctx: HandlerContext, message: Message):
        return data_part({"greeting": f"hello, {message.data['name']}"})

    asyncio.run(runtime.run())

# Layout
- :mod:`reach_mesh.parts` — :class:`Part` and :class:`Payload`: message content as plain
  Python values (``data_part({...})``, ``text_part(...)``, ``part.data``), nesting at most
  :data:`MAX_DATA_DEPTH` levels.
- :mod:`reach_mesh.message` — :class:`Message` (a received envelope) and :class:`Reply`.
- :mod:`reach_mesh.errors` — :class:`ReachError` (status code, message, ErrorInfo reason and
  metadata) and the :class:`Reason` constants.
- :mod:`reach_mesh.ids` — trace ids, ``traceparent`` values and UUIDv7 message ids.
- :mod:`reach_mesh.capability` — :class:`Capability`: a capability with its description and
  JSON Schemas, checked against the registry's bounds.
- :mod:`reach_mesh.config` — :class:`AgentConfig`.
- :mod:`reach_mesh.context` — :class:`HandlerContext`: what a handler knows (header, trace id,
  deadline, cancellation, reply metadata).
- :mod:`reach_mesh.models` — :class:`ModelSlots`: model calls in flight, reported in heartbeats.
- :mod:`reach_mesh.dedupe` — the window of recently handled message ids.
- :mod:`reach_mesh.runtime` — :class:`AgentRuntime` and :class:`RunningAgent`: serve, register,
  heartbeat, bounded concurrency, dedupe, drain.
- :mod:`reach_mesh.mux` — :class:`~reach_mesh.mux.MuxLink`: calls multiplexed on one CallMux
  stream.
- :mod:`reach_mesh.client` — :class:`MeshClient` and :class:`CallOptions`.
- :mod:`reach_mesh.tasks` — :class:`Task`, :class:`TaskEvent` and :class:`TaskStatus`.
"""

from reach_mesh.capability import Capability
from reach_mesh.client import MUX_MAX_MESSAGE_BYTES, CallOptions, MeshClient, PublishFailure, PublishResult
from reach_mesh.config import AgentConfig
from reach_mesh.context import HandlerContext
from reach_mesh.errors import ReachError, Reason
from reach_mesh.message import Message, Reply
from reach_mesh.models import ModelLoad, ModelSlots
from reach_mesh.parts import (
    MAX_DATA_DEPTH,
    DataTooDeep,
    JsonValue,
    Part,
    PartError,
    Payload,
    data_depth,
    data_part,
    raw_part,
    text_part,
    url_part,
)
from reach_mesh.runtime import (
    AgentRuntime,
    Handler,
    HandlerResult,
    RegistrationRefused,
    RunningAgent,
    StreamHandler,
)
from reach_mesh.tasks import HumanWait, NodeRun, Task, TaskEvent, TaskStatus
from reach_mesh.trust import DirectCallers, TlsConfig

__all__ = [
    "MAX_DATA_DEPTH",
    "MUX_MAX_MESSAGE_BYTES",
    "AgentConfig",
    "AgentRuntime",
    "CallOptions",
    "Capability",
    "DataTooDeep",
    "DirectCallers",
    "Handler",
    "HandlerContext",
    "HandlerResult",
    "HumanWait",
    "JsonValue",
    "MeshClient",
    "Message",
    "ModelLoad",
    "ModelSlots",
    "NodeRun",
    "Part",
    "PartError",
    "Payload",
    "PublishFailure",
    "PublishResult",
    "ReachError",
    "Reason",
    "Reply",
    "RegistrationRefused",
    "RunningAgent",
    "StreamHandler",
    "Task",
    "TaskEvent",
    "TaskStatus",
    "TlsConfig",
    "data_depth",
    "data_part",
    "raw_part",
    "text_part",
    "url_part",
]
