"""The A2A edge's contract, ``proto/lf/a2a/v1/a2a.proto``, against the descriptor the official
A2A SDK (a2a-sdk) ships: the same package, messages (nested ones too), fields (by number: name,
type, type name, label, oneof, proto3 ``optional``, JSON name), enums, and service methods.
Options (``google.api.*``), comments and imports are not compared. A difference is reported as
one readable line per drift, all of them in one assertion, so it is easy to fix."""

from __future__ import annotations

import importlib.resources
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from conftest import REPO

CONTRACT = "lf/a2a/v1/a2a.proto"
PROTO_ROOT = REPO / "proto"

Field = descriptor_pb2.FieldDescriptorProto


def compile_contract(root: Path = PROTO_ROOT, name: str = CONTRACT) -> descriptor_pb2.FileDescriptorProto:
    """``root/name`` compiled by grpc_tools' protoc (with its bundled well-known types)."""
    from grpc_tools import protoc  # type: ignore[import-untyped]

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory(prefix="a2a-contract-") as tmp:
        out = Path(tmp) / "a2a.pb"
        status = protoc.main(
            [
                "protoc",
                f"--proto_path={root}",
                f"--proto_path={well_known}",
                "--include_imports",
                f"--descriptor_set_out={out}",
                str(root / name),
            ]
        )
        assert status == 0, f"protoc failed to compile {root / name} (exit {status}); its errors are above"
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    [found] = [f for f in files if f.name == name]
    return found


def sdk_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The ``lf.a2a.v1`` file descriptor a2a-sdk ships (``a2a.types.a2a_pb2``)."""
    from a2a.types import a2a_pb2

    return descriptor_pb2.FileDescriptorProto.FromString(a2a_pb2.DESCRIPTOR.serialized_pb)


def _label(field: Field) -> str:
    return Field.Label.Name(field.label)


def _type(field: Field) -> str:
    return Field.Type.Name(field.type)


def _oneof(message: descriptor_pb2.DescriptorProto, field: Field) -> str | None:
    return message.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None


def _messages(
    messages: list[descriptor_pb2.DescriptorProto], prefix: str = ""
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    """Every message, nested ones included, by its dotted name inside the package."""
    for message in messages:
        name = f"{prefix}{message.name}"
        yield name, message
        yield from _messages(list(message.nested_type), f"{name}.")


def _enums(file: descriptor_pb2.FileDescriptorProto) -> dict[str, descriptor_pb2.EnumDescriptorProto]:
    enums = {enum.name: enum for enum in file.enum_type}
    for name, message in _messages(list(file.message_type)):
        enums.update({f"{name}.{enum.name}": enum for enum in message.enum_type})
    return enums


def _compare_fields(
    name: str, here: descriptor_pb2.DescriptorProto, sdk: descriptor_pb2.DescriptorProto, out: list[str]
) -> None:
    ours = {field.number: field for field in here.field}
    theirs = {field.number: field for field in sdk.field}
    for number in sorted(ours.keys() - theirs.keys()):
        out.append(f"{name}.{ours[number].name}: field {number} here, not in a2a-sdk")
    for number in sorted(theirs.keys() - ours.keys()):
        by_name = [f for f in here.field if f.name == theirs[number].name]
        hint = f" (here it is number {by_name[0].number})" if by_name else ""
        out.append(f"{name}.{theirs[number].name}: field {number} in a2a-sdk, missing here{hint}")
    for number in sorted(ours.keys() & theirs.keys()):
        a, b = ours[number], theirs[number]
        where = f"{name}.{b.name} (field {number})"
        checks: list[tuple[str, object, object]] = [
            ("name", a.name, b.name),
            ("type", _type(a), _type(b)),
            ("type_name", a.type_name, b.type_name),
            ("label", _label(a), _label(b)),
            ("oneof", _oneof(here, a), _oneof(sdk, b)),
            ("proto3_optional", a.proto3_optional, b.proto3_optional),
        ]
        if a.json_name and b.json_name:
            checks.append(("json_name", a.json_name, b.json_name))
        for what, mine, sdks in checks:
            if mine != sdks:
                out.append(f"{where}: {what} {mine!r} here, {sdks!r} in a2a-sdk")
    if here.options.map_entry != sdk.options.map_entry:
        out.append(f"{name}: map entry {here.options.map_entry} here, {sdk.options.map_entry} in a2a-sdk")


def _compare_enum(
    name: str, here: descriptor_pb2.EnumDescriptorProto, sdk: descriptor_pb2.EnumDescriptorProto, out: list[str]
) -> None:
    ours = {value.name: value.number for value in here.value}
    theirs = {value.name: value.number for value in sdk.value}
    for value in sorted(ours.keys() - theirs.keys()):
        out.append(f"{name}.{value}: value {ours[value]} here, not in a2a-sdk")
    for value in sorted(theirs.keys() - ours.keys()):
        out.append(f"{name}.{value}: value {theirs[value]} in a2a-sdk, missing here")
    for value in sorted(ours.keys() & theirs.keys()):
        if ours[value] != theirs[value]:
            out.append(f"{name}.{value}: number {ours[value]} here, {theirs[value]} in a2a-sdk")


def _compare_services(
    here: descriptor_pb2.FileDescriptorProto, sdk: descriptor_pb2.FileDescriptorProto, out: list[str]
) -> None:
    ours = {service.name: service for service in here.service}
    theirs = {service.name: service for service in sdk.service}
    for name in sorted(ours.keys() - theirs.keys()):
        out.append(f"service {name}: here, not in a2a-sdk")
    for name in sorted(theirs.keys() - ours.keys()):
        out.append(f"service {name}: in a2a-sdk, missing here")
    for name in sorted(ours.keys() & theirs.keys()):
        mine = {method.name: method for method in ours[name].method}
        sdks = {method.name: method for method in theirs[name].method}
        for method in sorted(mine.keys() - sdks.keys()):
            out.append(f"{name}.{method}: method here, not in a2a-sdk")
        for method in sorted(sdks.keys() - mine.keys()):
            out.append(f"{name}.{method}: method in a2a-sdk, missing here")
        for method in sorted(mine.keys() & sdks.keys()):
            a, b = mine[method], sdks[method]
            for what, x, y in [
                ("input_type", a.input_type, b.input_type),
                ("output_type", a.output_type, b.output_type),
                ("client_streaming", a.client_streaming, b.client_streaming),
                ("server_streaming", a.server_streaming, b.server_streaming),
            ]:
                if x != y:
                    out.append(f"{name}.{method}: {what} {x!r} here, {y!r} in a2a-sdk")


def differences(here: descriptor_pb2.FileDescriptorProto, sdk: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Every difference between the two files that matters on the wire (and to generated
    code), one readable line each; empty when they agree."""
    out: list[str] = []
    if here.package != sdk.package:
        out.append(f"package: {here.package!r} here, {sdk.package!r} in a2a-sdk")
    if here.syntax != sdk.syntax:
        out.append(f"syntax: {here.syntax!r} here, {sdk.syntax!r} in a2a-sdk")

    ours = dict(_messages(list(here.message_type)))
    theirs = dict(_messages(list(sdk.message_type)))
    for name in sorted(ours.keys() - theirs.keys()):
        out.append(f"message {name}: here, not in a2a-sdk")
    for name in sorted(theirs.keys() - ours.keys()):
        out.append(f"message {name}: in a2a-sdk, missing here")
    for name in sorted(ours.keys() & theirs.keys()):
        _compare_fields(name, ours[name], theirs[name], out)

    our_enums, their_enums = _enums(here), _enums(sdk)
    for name in sorted(our_enums.keys() - their_enums.keys()):
        out.append(f"enum {name}: here, not in a2a-sdk")
    for name in sorted(their_enums.keys() - our_enums.keys()):
        out.append(f"enum {name}: in a2a-sdk, missing here")
    for name in sorted(our_enums.keys() & their_enums.keys()):
        _compare_enum(name, our_enums[name], their_enums[name], out)

    _compare_services(here, sdk, out)
    return out


def test_the_comparison_finds_drift() -> None:
    """The comparison itself: a2a-sdk's descriptor agrees with itself, and a copy with a
    renumbered, a renamed and a removed field, a moved oneof member, an enum value changed
    and a method's streaming flag flipped is reported line by line."""
    sdk = sdk_descriptor()
    assert differences(sdk, sdk_descriptor()) == []

    drifted = descriptor_pb2.FileDescriptorProto()
    drifted.CopyFrom(sdk)
    messages = {message.name: message for message in drifted.message_type}
    [status] = [f for f in messages["Task"].field if f.name == "status"]
    status.number = 30
    [context] = [f for f in messages["Message"].field if f.name == "context_id"]
    context.name = "context"
    [text] = [f for f in messages["Part"].field if f.name == "text"]
    text.ClearField("oneof_index")
    del messages["Artifact"].field[-1]
    [state] = [e for e in drifted.enum_type if e.name == "TaskState"]
    state.value[1].number = 42
    drifted.service[0].method[0].server_streaming = True

    found = differences(drifted, sdk)
    expected = [
        "Task.status: field 30 here, not in a2a-sdk",
        "Task.status: field 3 in a2a-sdk, missing here (here it is number 30)",
        "Message.context_id (field 2): name 'context' here, 'context_id' in a2a-sdk",
        "Part.text (field 1): oneof None here, 'content' in a2a-sdk",
        f"TaskState.{state.value[1].name}: number 42 here, 1 in a2a-sdk",
        "A2AService.SendMessage: server_streaming True here, False in a2a-sdk",
    ]
    for line in expected:
        assert line in found, f"{line!r} not among {found}"
    assert any(line.startswith("Artifact.") and "missing here" in line for line in found), found


def test_contract_matches_a2a_sdk() -> None:
    """``proto/lf/a2a/v1/a2a.proto`` is, field for field, the A2A v1 protocol a2a-sdk speaks."""
    if not (PROTO_ROOT / CONTRACT).is_file():
        pytest.fail(f"{PROTO_ROOT / CONTRACT} does not exist", pytrace=False)
    drift = differences(compile_contract(), sdk_descriptor())
    assert not drift, f"{CONTRACT} differs from a2a-sdk's lf.a2a.v1 ({len(drift)}):\n" + "\n".join(drift)
