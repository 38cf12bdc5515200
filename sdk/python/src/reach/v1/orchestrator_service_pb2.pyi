import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from reach.v1 import envelope_pb2 as _envelope_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATUS_UNSPECIFIED: _ClassVar[TaskStatus]
    TASK_STATUS_PENDING: _ClassVar[TaskStatus]
    TASK_STATUS_DISPATCHED: _ClassVar[TaskStatus]
    TASK_STATUS_PROCESSING: _ClassVar[TaskStatus]
    TASK_STATUS_WAITING_HUMAN: _ClassVar[TaskStatus]
    TASK_STATUS_SUCCEEDED: _ClassVar[TaskStatus]
    TASK_STATUS_FAILED: _ClassVar[TaskStatus]
    TASK_STATUS_PARTIAL: _ClassVar[TaskStatus]
    TASK_STATUS_CANCELLED: _ClassVar[TaskStatus]

class NodeStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATUS_UNSPECIFIED: _ClassVar[NodeStatus]
    NODE_STATUS_RUNNING: _ClassVar[NodeStatus]
    NODE_STATUS_SUCCEEDED: _ClassVar[NodeStatus]
    NODE_STATUS_FAILED: _ClassVar[NodeStatus]
    NODE_STATUS_PARTIAL: _ClassVar[NodeStatus]
    NODE_STATUS_CANCELLED: _ClassVar[NodeStatus]
TASK_STATUS_UNSPECIFIED: TaskStatus
TASK_STATUS_PENDING: TaskStatus
TASK_STATUS_DISPATCHED: TaskStatus
TASK_STATUS_PROCESSING: TaskStatus
TASK_STATUS_WAITING_HUMAN: TaskStatus
TASK_STATUS_SUCCEEDED: TaskStatus
TASK_STATUS_FAILED: TaskStatus
TASK_STATUS_PARTIAL: TaskStatus
TASK_STATUS_CANCELLED: TaskStatus
NODE_STATUS_UNSPECIFIED: NodeStatus
NODE_STATUS_RUNNING: NodeStatus
NODE_STATUS_SUCCEEDED: NodeStatus
NODE_STATUS_FAILED: NodeStatus
NODE_STATUS_PARTIAL: NodeStatus
NODE_STATUS_CANCELLED: NodeStatus

class Task(_message.Message):
    __slots__ = ("task_id", "flow_id", "flow_version", "status", "current_node", "input", "output", "error", "trace_id", "created_at", "updated_at", "ended_at", "nodes", "failed_node", "waiting", "usage", "last_sequence", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FLOW_ID_FIELD_NUMBER: _ClassVar[int]
    FLOW_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_NODE_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    flow_id: str
    flow_version: int
    status: TaskStatus
    current_node: str
    input: _struct_pb2.Value
    output: _struct_pb2.Value
    error: str
    trace_id: str
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    nodes: _containers.RepeatedCompositeFieldContainer[NodeRun]
    failed_node: str
    waiting: HumanWait
    usage: TokenUsage
    last_sequence: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, task_id: _Optional[str] = ..., flow_id: _Optional[str] = ..., flow_version: _Optional[int] = ..., status: _Optional[_Union[TaskStatus, str]] = ..., current_node: _Optional[str] = ..., input: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., output: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., error: _Optional[str] = ..., trace_id: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., nodes: _Optional[_Iterable[_Union[NodeRun, _Mapping]]] = ..., failed_node: _Optional[str] = ..., waiting: _Optional[_Union[HumanWait, _Mapping]] = ..., usage: _Optional[_Union[TokenUsage, _Mapping]] = ..., last_sequence: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TokenUsage(_message.Message):
    __slots__ = ("input_tokens", "output_tokens", "model_calls")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_CALLS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    output_tokens: int
    model_calls: int
    def __init__(self, input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., model_calls: _Optional[int] = ...) -> None: ...

class HumanWait(_message.Message):
    __slots__ = ("node_id", "prompt", "input_schema", "deadline")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    prompt: str
    input_schema: _struct_pb2.Value
    deadline: _timestamp_pb2.Timestamp
    def __init__(self, node_id: _Optional[str] = ..., prompt: _Optional[str] = ..., input_schema: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class NodeRun(_message.Message):
    __slots__ = ("node_id", "node_type", "status", "attempts", "message_id", "input", "output", "error", "started_at", "ended_at", "next_node", "usage")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_TYPE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_type: str
    status: NodeStatus
    attempts: int
    message_id: str
    input: _struct_pb2.Value
    output: _struct_pb2.Value
    error: str
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    next_node: str
    usage: TokenUsage
    def __init__(self, node_id: _Optional[str] = ..., node_type: _Optional[str] = ..., status: _Optional[_Union[NodeStatus, str]] = ..., attempts: _Optional[int] = ..., message_id: _Optional[str] = ..., input: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., output: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., error: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., next_node: _Optional[str] = ..., usage: _Optional[_Union[TokenUsage, _Mapping]] = ...) -> None: ...

class TaskEvent(_message.Message):
    __slots__ = ("task_id", "sequence", "at", "kind", "node_id", "detail", "status")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    sequence: int
    at: _timestamp_pb2.Timestamp
    kind: str
    node_id: str
    detail: _struct_pb2.Value
    status: TaskStatus
    def __init__(self, task_id: _Optional[str] = ..., sequence: _Optional[int] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., kind: _Optional[str] = ..., node_id: _Optional[str] = ..., detail: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., status: _Optional[_Union[TaskStatus, str]] = ...) -> None: ...

class FlowSummary(_message.Message):
    __slots__ = ("flow_id", "version", "initial", "node_count", "applied_at", "source", "description", "yaml")
    FLOW_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIAL_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    APPLIED_AT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    YAML_FIELD_NUMBER: _ClassVar[int]
    flow_id: str
    version: int
    initial: str
    node_count: int
    applied_at: _timestamp_pb2.Timestamp
    source: str
    description: str
    yaml: str
    def __init__(self, flow_id: _Optional[str] = ..., version: _Optional[int] = ..., initial: _Optional[str] = ..., node_count: _Optional[int] = ..., applied_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., source: _Optional[str] = ..., description: _Optional[str] = ..., yaml: _Optional[str] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("header", "payload_type", "payload_bytes", "status_code", "status_message", "latency", "routed_at", "instance_id", "recorded_by")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_TYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    ROUTED_AT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDED_BY_FIELD_NUMBER: _ClassVar[int]
    header: _envelope_pb2.Header
    payload_type: str
    payload_bytes: int
    status_code: int
    status_message: str
    latency: _duration_pb2.Duration
    routed_at: _timestamp_pb2.Timestamp
    instance_id: str
    recorded_by: str
    def __init__(self, header: _Optional[_Union[_envelope_pb2.Header, _Mapping]] = ..., payload_type: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ..., latency: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., routed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., instance_id: _Optional[str] = ..., recorded_by: _Optional[str] = ...) -> None: ...

class DumpRecord(_message.Message):
    __slots__ = ("at", "message", "event")
    AT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    at: _timestamp_pb2.Timestamp
    message: LedgerEntry
    event: TaskEvent
    def __init__(self, at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., message: _Optional[_Union[LedgerEntry, _Mapping]] = ..., event: _Optional[_Union[TaskEvent, _Mapping]] = ...) -> None: ...

class DeadLetter(_message.Message):
    __slots__ = ("task", "failed_node", "error")
    TASK_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    task: Task
    failed_node: str
    error: str
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ..., failed_node: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class StartTaskRequest(_message.Message):
    __slots__ = ("flow_id", "flow_version", "input", "task_id", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FLOW_ID_FIELD_NUMBER: _ClassVar[int]
    FLOW_VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    flow_id: str
    flow_version: int
    input: _struct_pb2.Value
    task_id: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, flow_id: _Optional[str] = ..., flow_version: _Optional[int] = ..., input: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., task_id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StartTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class GetTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class GetTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("status", "flow_id", "page_size", "page_token", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FLOW_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    status: TaskStatus
    flow_id: str
    page_size: int
    page_token: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, status: _Optional[_Union[TaskStatus, str]] = ..., flow_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks", "next_page_token")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    next_page_token: str
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchTaskRequest(_message.Message):
    __slots__ = ("task_id", "after_sequence")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    after_sequence: int
    def __init__(self, task_id: _Optional[str] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class WatchTaskResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: TaskEvent
    def __init__(self, event: _Optional[_Union[TaskEvent, _Mapping]] = ...) -> None: ...

class ResumeTaskRequest(_message.Message):
    __slots__ = ("task_id", "node_id", "input")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    node_id: str
    input: _struct_pb2.Value
    def __init__(self, task_id: _Optional[str] = ..., node_id: _Optional[str] = ..., input: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...

class ResumeTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class CancelTaskRequest(_message.Message):
    __slots__ = ("task_id", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class RetryTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class RetryTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class ListDeadLettersRequest(_message.Message):
    __slots__ = ("flow_id", "page_size", "page_token")
    FLOW_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    flow_id: str
    page_size: int
    page_token: str
    def __init__(self, flow_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListDeadLettersResponse(_message.Message):
    __slots__ = ("dead_letters", "next_page_token")
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    dead_letters: _containers.RepeatedCompositeFieldContainer[DeadLetter]
    next_page_token: str
    def __init__(self, dead_letters: _Optional[_Iterable[_Union[DeadLetter, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ApplyFlowRequest(_message.Message):
    __slots__ = ("yaml", "source")
    YAML_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    yaml: str
    source: str
    def __init__(self, yaml: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class ApplyFlowResponse(_message.Message):
    __slots__ = ("flow", "changed")
    FLOW_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    flow: FlowSummary
    changed: bool
    def __init__(self, flow: _Optional[_Union[FlowSummary, _Mapping]] = ..., changed: _Optional[bool] = ...) -> None: ...

class ListFlowsRequest(_message.Message):
    __slots__ = ("flow_id",)
    FLOW_ID_FIELD_NUMBER: _ClassVar[int]
    flow_id: str
    def __init__(self, flow_id: _Optional[str] = ...) -> None: ...

class ListFlowsResponse(_message.Message):
    __slots__ = ("flows",)
    FLOWS_FIELD_NUMBER: _ClassVar[int]
    flows: _containers.RepeatedCompositeFieldContainer[FlowSummary]
    def __init__(self, flows: _Optional[_Iterable[_Union[FlowSummary, _Mapping]]] = ...) -> None: ...

class RecordMessagesRequest(_message.Message):
    __slots__ = ("entries", "dropped")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    dropped: int
    def __init__(self, entries: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ..., dropped: _Optional[int] = ...) -> None: ...

class RecordMessagesResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class DumpTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class DumpTaskResponse(_message.Message):
    __slots__ = ("task", "records")
    TASK_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    task: Task
    records: _containers.RepeatedCompositeFieldContainer[DumpRecord]
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ..., records: _Optional[_Iterable[_Union[DumpRecord, _Mapping]]] = ...) -> None: ...

class TaskWebhook(_message.Message):
    __slots__ = ("webhook_id", "task_id", "url", "token", "auth_scheme", "auth_credentials", "format", "delivered_sequence", "created_at", "failed_attempts", "last_error", "next_attempt_at")
    WEBHOOK_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    AUTH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    AUTH_CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FAILED_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    NEXT_ATTEMPT_AT_FIELD_NUMBER: _ClassVar[int]
    webhook_id: str
    task_id: str
    url: str
    token: str
    auth_scheme: str
    auth_credentials: str
    format: str
    delivered_sequence: int
    created_at: _timestamp_pb2.Timestamp
    failed_attempts: int
    last_error: str
    next_attempt_at: _timestamp_pb2.Timestamp
    def __init__(self, webhook_id: _Optional[str] = ..., task_id: _Optional[str] = ..., url: _Optional[str] = ..., token: _Optional[str] = ..., auth_scheme: _Optional[str] = ..., auth_credentials: _Optional[str] = ..., format: _Optional[str] = ..., delivered_sequence: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., failed_attempts: _Optional[int] = ..., last_error: _Optional[str] = ..., next_attempt_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class CreateTaskWebhookRequest(_message.Message):
    __slots__ = ("task_id", "webhook_id", "url", "token", "auth_scheme", "auth_credentials", "format")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    WEBHOOK_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    AUTH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    AUTH_CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    webhook_id: str
    url: str
    token: str
    auth_scheme: str
    auth_credentials: str
    format: str
    def __init__(self, task_id: _Optional[str] = ..., webhook_id: _Optional[str] = ..., url: _Optional[str] = ..., token: _Optional[str] = ..., auth_scheme: _Optional[str] = ..., auth_credentials: _Optional[str] = ..., format: _Optional[str] = ...) -> None: ...

class CreateTaskWebhookResponse(_message.Message):
    __slots__ = ("webhook",)
    WEBHOOK_FIELD_NUMBER: _ClassVar[int]
    webhook: TaskWebhook
    def __init__(self, webhook: _Optional[_Union[TaskWebhook, _Mapping]] = ...) -> None: ...

class GetTaskWebhookRequest(_message.Message):
    __slots__ = ("task_id", "webhook_id")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    WEBHOOK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    webhook_id: str
    def __init__(self, task_id: _Optional[str] = ..., webhook_id: _Optional[str] = ...) -> None: ...

class GetTaskWebhookResponse(_message.Message):
    __slots__ = ("webhook",)
    WEBHOOK_FIELD_NUMBER: _ClassVar[int]
    webhook: TaskWebhook
    def __init__(self, webhook: _Optional[_Union[TaskWebhook, _Mapping]] = ...) -> None: ...

class ListTaskWebhooksRequest(_message.Message):
    __slots__ = ("task_id", "page_size", "page_token")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    page_size: int
    page_token: str
    def __init__(self, task_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListTaskWebhooksResponse(_message.Message):
    __slots__ = ("webhooks", "next_page_token")
    WEBHOOKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    webhooks: _containers.RepeatedCompositeFieldContainer[TaskWebhook]
    next_page_token: str
    def __init__(self, webhooks: _Optional[_Iterable[_Union[TaskWebhook, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteTaskWebhookRequest(_message.Message):
    __slots__ = ("task_id", "webhook_id")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    WEBHOOK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    webhook_id: str
    def __init__(self, task_id: _Optional[str] = ..., webhook_id: _Optional[str] = ...) -> None: ...

class DeleteTaskWebhookResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
