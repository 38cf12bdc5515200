import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_STATE_UNSPECIFIED: _ClassVar[InstanceState]
    INSTANCE_STATE_REGISTERED: _ClassVar[InstanceState]
    INSTANCE_STATE_READY: _ClassVar[InstanceState]
    INSTANCE_STATE_BUSY: _ClassVar[InstanceState]
    INSTANCE_STATE_DRAINING: _ClassVar[InstanceState]
    INSTANCE_STATE_OFFLINE: _ClassVar[InstanceState]

class SnapshotCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SNAPSHOT_CAUSE_UNSPECIFIED: _ClassVar[SnapshotCause]
    SNAPSHOT_CAUSE_START: _ClassVar[SnapshotCause]
    SNAPSHOT_CAUSE_EPOCH_CHANGED: _ClassVar[SnapshotCause]
    SNAPSHOT_CAUSE_COMPACTED: _ClassVar[SnapshotCause]
    SNAPSHOT_CAUSE_LAGGED: _ClassVar[SnapshotCause]

class DescriptorSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DESCRIPTOR_SOURCE_UNSPECIFIED: _ClassVar[DescriptorSource]
    DESCRIPTOR_SOURCE_PROTOCOL_REGISTRY: _ClassVar[DescriptorSource]
    DESCRIPTOR_SOURCE_REGISTRATION: _ClassVar[DescriptorSource]
    DESCRIPTOR_SOURCE_NONE: _ClassVar[DescriptorSource]
INSTANCE_STATE_UNSPECIFIED: InstanceState
INSTANCE_STATE_REGISTERED: InstanceState
INSTANCE_STATE_READY: InstanceState
INSTANCE_STATE_BUSY: InstanceState
INSTANCE_STATE_DRAINING: InstanceState
INSTANCE_STATE_OFFLINE: InstanceState
SNAPSHOT_CAUSE_UNSPECIFIED: SnapshotCause
SNAPSHOT_CAUSE_START: SnapshotCause
SNAPSHOT_CAUSE_EPOCH_CHANGED: SnapshotCause
SNAPSHOT_CAUSE_COMPACTED: SnapshotCause
SNAPSHOT_CAUSE_LAGGED: SnapshotCause
DESCRIPTOR_SOURCE_UNSPECIFIED: DescriptorSource
DESCRIPTOR_SOURCE_PROTOCOL_REGISTRY: DescriptorSource
DESCRIPTOR_SOURCE_REGISTRATION: DescriptorSource
DESCRIPTOR_SOURCE_NONE: DescriptorSource

class Capability(_message.Message):
    __slots__ = ("name", "version", "description", "input_schema", "output_schema")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    description: str
    input_schema: str
    output_schema: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., description: _Optional[str] = ..., input_schema: _Optional[str] = ..., output_schema: _Optional[str] = ...) -> None: ...

class InstanceSpec(_message.Message):
    __slots__ = ("service", "instance_id", "endpoint", "capabilities", "protocol_version", "weight", "max_concurrency", "topics", "labels", "grpc_services")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    GRPC_SERVICES_FIELD_NUMBER: _ClassVar[int]
    service: str
    instance_id: str
    endpoint: str
    capabilities: _containers.RepeatedCompositeFieldContainer[Capability]
    protocol_version: str
    weight: int
    max_concurrency: int
    topics: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    grpc_services: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, service: _Optional[str] = ..., instance_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., capabilities: _Optional[_Iterable[_Union[Capability, _Mapping]]] = ..., protocol_version: _Optional[str] = ..., weight: _Optional[int] = ..., max_concurrency: _Optional[int] = ..., topics: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., grpc_services: _Optional[_Iterable[str]] = ...) -> None: ...

class Instance(_message.Message):
    __slots__ = ("spec", "state", "in_flight", "lease_id", "lease_expires_at", "registered_at", "revision", "model_calls_in_flight", "model_slots_free", "health_probe_error")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    MODEL_CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MODEL_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_PROBE_ERROR_FIELD_NUMBER: _ClassVar[int]
    spec: InstanceSpec
    state: InstanceState
    in_flight: int
    lease_id: str
    lease_expires_at: _timestamp_pb2.Timestamp
    registered_at: _timestamp_pb2.Timestamp
    revision: int
    model_calls_in_flight: int
    model_slots_free: int
    health_probe_error: str
    def __init__(self, spec: _Optional[_Union[InstanceSpec, _Mapping]] = ..., state: _Optional[_Union[InstanceState, str]] = ..., in_flight: _Optional[int] = ..., lease_id: _Optional[str] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., registered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revision: _Optional[int] = ..., model_calls_in_flight: _Optional[int] = ..., model_slots_free: _Optional[int] = ..., health_probe_error: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("instance", "lease_ttl")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceSpec
    lease_ttl: _duration_pb2.Duration
    def __init__(self, instance: _Optional[_Union[InstanceSpec, _Mapping]] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease_id", "lease_ttl", "instance")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ttl: _duration_pb2.Duration
    instance: Instance
    def __init__(self, lease_id: _Optional[str] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., instance: _Optional[_Union[Instance, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("instance_id", "lease_id", "state", "in_flight", "model_calls_in_flight", "model_slots_free")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MODEL_CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MODEL_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    lease_id: str
    state: InstanceState
    in_flight: int
    model_calls_in_flight: int
    model_slots_free: int
    def __init__(self, instance_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., state: _Optional[_Union[InstanceState, str]] = ..., in_flight: _Optional[int] = ..., model_calls_in_flight: _Optional[int] = ..., model_slots_free: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_expires_at", "state")
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    lease_expires_at: _timestamp_pb2.Timestamp
    state: InstanceState
    def __init__(self, lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., state: _Optional[_Union[InstanceState, str]] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("instance_id", "lease_id")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    lease_id: str
    def __init__(self, instance_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("service", "capability")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    service: str
    capability: str
    def __init__(self, service: _Optional[str] = ..., capability: _Optional[str] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances", "revision")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    revision: int
    def __init__(self, instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("after_revision", "epoch")
    AFTER_REVISION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    after_revision: int
    epoch: str
    def __init__(self, after_revision: _Optional[int] = ..., epoch: _Optional[str] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("revision", "snapshot", "upserted", "removed", "epoch")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    UPSERTED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    revision: int
    snapshot: WatchSnapshot
    upserted: Instance
    removed: Instance
    epoch: str
    def __init__(self, revision: _Optional[int] = ..., snapshot: _Optional[_Union[WatchSnapshot, _Mapping]] = ..., upserted: _Optional[_Union[Instance, _Mapping]] = ..., removed: _Optional[_Union[Instance, _Mapping]] = ..., epoch: _Optional[str] = ...) -> None: ...

class WatchSnapshot(_message.Message):
    __slots__ = ("instances", "cause", "continues")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    cause: SnapshotCause
    continues: bool
    def __init__(self, instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ..., cause: _Optional[_Union[SnapshotCause, str]] = ..., continues: _Optional[bool] = ...) -> None: ...

class ListCapabilitiesRequest(_message.Message):
    __slots__ = ("name_prefix", "page_size", "page_token")
    NAME_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    name_prefix: str
    page_size: int
    page_token: str
    def __init__(self, name_prefix: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListCapabilitiesResponse(_message.Message):
    __slots__ = ("capabilities", "revision", "next_page_token")
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    capabilities: _containers.RepeatedCompositeFieldContainer[CapabilityDescriptor]
    revision: int
    next_page_token: str
    def __init__(self, capabilities: _Optional[_Iterable[_Union[CapabilityDescriptor, _Mapping]]] = ..., revision: _Optional[int] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CapabilityDescriptor(_message.Message):
    __slots__ = ("name", "description", "versions", "input_schema", "output_schema", "idempotent", "routable_instances", "instances", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENT_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    versions: _containers.RepeatedScalarFieldContainer[str]
    input_schema: str
    output_schema: str
    idempotent: bool
    routable_instances: int
    instances: int
    source: DescriptorSource
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., versions: _Optional[_Iterable[str]] = ..., input_schema: _Optional[str] = ..., output_schema: _Optional[str] = ..., idempotent: _Optional[bool] = ..., routable_instances: _Optional[int] = ..., instances: _Optional[int] = ..., source: _Optional[_Union[DescriptorSource, str]] = ...) -> None: ...
