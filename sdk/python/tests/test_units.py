"""The SDK's pure pieces: parts, ids, dedupe, capability bounds, error reasons."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from conftest import REPO
from reach.v1 import envelope_pb2
from reach_mesh import (
    MAX_DATA_DEPTH,
    AgentConfig,
    AgentRuntime,
    Capability,
    DataTooDeep,
    Part,
    PartError,
    Payload,
    ReachError,
    Reason,
    data_depth,
    data_part,
    raw_part,
    text_part,
    url_part,
)
from reach_mesh.dedupe import DedupeCache
from reach_mesh.parts import too_deep_part
from reach_mesh.ids import is_trace_id, new_message_id, new_trace_id, trace_id_of_traceparent, traceparent


def test_parts_round_trip_as_plain_python_values() -> None:
    value = {"a": 1, "b": [True, None, "x", 2.5], "c": {"d": -3, "e": {}}, "f": [], "big": 2**53 + 2}
    part = data_part(value)
    wire = part.to_proto()
    # On the wire: a google.protobuf.Value, numbers as doubles.
    assert wire.data.struct_value.fields["c"].struct_value.fields["d"].number_value == -3.0
    assert wire.media_type == "application/json"
    back = Part.from_proto(envelope_pb2.Part.FromString(wire.SerializeToString()))
    # Whole numbers within 2**53 come back as int; larger ones as float (as in Rust).
    assert back.data == {**value, "big": float(2**53 + 2)}
    assert isinstance(back.data["a"], int) and isinstance(back.data["b"][3], float)
    assert back.kind == "data" and back.text is None

    for made, kind, content in [
        (text_part("hello"), "text", "hello"),
        (raw_part(b"\x00\x01", media_type="image/png", filename="a.png"), "raw", b"\x00\x01"),
        (url_part("https://example.com/a"), "url", "https://example.com/a"),
    ]:
        again = Part.from_proto(made.to_proto())
        assert (again.kind, again.content) == (kind, content)
        assert again == made
    assert text_part("x").to_proto().media_type == "text/plain"

    payload = Payload("complaint.submitted", (text_part("t"), data_part({"k": "v"})))
    assert Payload.from_proto(payload.to_proto()) == payload
    assert payload.data == {"k": "v"} and payload.text == "t"


def test_parts_refuse_what_json_cannot_carry_naming_the_path() -> None:
    with pytest.raises(PartError, match=r"\$\.items\[1\] is nan"):
        data_part({"items": [1, float("nan")]})
    with pytest.raises(PartError, match=r"\$ has the key 1"):
        data_part({1: "x"})
    with pytest.raises(PartError, match=r"\$\.when is a set"):
        data_part({"when": {1}})
    with pytest.raises(PartError, match="wrap a dict in data_part"):
        Payload.of({"not": "a part"})  # type: ignore[arg-type]
    # A part copies its value: later changes to the dict do not change the part.
    source = {"n": 1}
    part = data_part(source)
    source["n"] = 2
    assert part.data == {"n": 1}


def test_data_nests_at_most_max_data_depth_levels() -> None:
    # Each object or list is one level; a scalar none.
    assert MAX_DATA_DEPTH == 31
    assert [data_depth(v) for v in (1, "x", None, [], {}, {"a": [1]}, [[1], [[2]]], ({"a": ()},))] == [
        0, 0, 0, 1, 1, 2, 3, 3,
    ]
    at_limit: object = 1
    for level in range(MAX_DATA_DEPTH):
        at_limit = {"a": at_limit} if level % 2 else [at_limit]
    assert data_part(at_limit).data == at_limit
    assert data_depth(at_limit) == MAX_DATA_DEPTH

    with pytest.raises(DataTooDeep) as refused:
        data_part({"ok": 1, "deep": [at_limit]})
    error = refused.value
    assert isinstance(error, PartError)
    assert (error.depth, error.limit) == (MAX_DATA_DEPTH + 2, MAX_DATA_DEPTH)
    # The path names where the first level past the limit begins: 31 steps below $.
    assert error.path.startswith("$.deep[0][0].a[0].a")
    assert len(re.findall(r"\.\w+|\[\d+\]", error.path)) == MAX_DATA_DEPTH
    assert f"nests {MAX_DATA_DEPTH + 2} levels deep, over the limit of {MAX_DATA_DEPTH}" in str(error)
    assert error.path in str(error)

    # Any depth is measured without recursion, and refused (not a RecursionError).
    very_deep: object = 1
    for _ in range(100_000):
        very_deep = [very_deep]
    assert data_depth(very_deep) == 100_000
    with pytest.raises(DataTooDeep, match="nests 100000 levels deep"):
        data_part(very_deep)
    # A Part built without data_part is refused when it is encoded.
    with pytest.raises(DataTooDeep):
        Part("data", very_deep).to_proto()

    # The protobuf side: the first data part over the limit, with its depth.
    payload = envelope_pb2.Payload(parts=[text_part("t").to_proto(), data_part(at_limit).to_proto()])
    assert too_deep_part(payload) is None
    value = payload.parts.add().data
    for _ in range(MAX_DATA_DEPTH + 4):
        value = value.struct_value.fields["a"]
    value.number_value = 1
    assert too_deep_part(payload) == (2, MAX_DATA_DEPTH + 4)


def test_trace_ids_and_traceparent_follow_w3c_trace_context() -> None:
    trace_id = new_trace_id()
    assert re.fullmatch(r"[0-9a-f]{32}", trace_id) and trace_id != "0" * 32
    assert is_trace_id(trace_id)
    assert not is_trace_id("4BF92F3577B34DA6A3CE929D0E0E4736") and not is_trace_id("0" * 32)
    header = traceparent(trace_id)
    version, traced, span, flags = header.split("-")
    assert (version, traced, flags) == ("00", trace_id, "01")
    assert re.fullmatch(r"[0-9a-f]{16}", span) and span != "0" * 16
    assert traceparent(trace_id, "00f067aa0ba902b7") == f"00-{trace_id}-00f067aa0ba902b7-01"
    assert trace_id_of_traceparent(header) == trace_id
    for malformed in [
        "00-xyz-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
    ]:
        assert trace_id_of_traceparent(malformed) is None, malformed
    with pytest.raises(ValueError):
        traceparent("abc")


def test_message_ids_are_time_ordered_uuid7s() -> None:
    ids = [new_message_id() for _ in range(50)]
    assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", i) for i in ids)
    # The first 48 bits are the millisecond timestamp: never decreasing.
    stamps = [int(i.replace("-", "")[:12], 16) for i in ids]
    assert stamps == sorted(stamps)


async def test_dedupe_shares_a_slot_until_the_window_passes_and_waits_for_a_running_first() -> None:
    now = [0.0]
    cache: DedupeCache[str] = DedupeCache(window=10, capacity=100, max_bytes=1 << 20, clock=lambda: now[0])
    runs = []
    started = asyncio.Event()
    release = asyncio.Event()

    async def first() -> str:
        runs.append("first")
        started.set()
        await release.wait()
        return "reply-1"

    async def second() -> str:
        runs.append("second")
        return "reply-2"

    one = asyncio.ensure_future(cache.slot("a").get_or_init(first))
    await started.wait()
    # A duplicate while the first runs waits for it and gets its outcome.
    two = asyncio.ensure_future(cache.slot("a").get_or_init(second))
    await asyncio.sleep(0)
    assert not two.done()
    release.set()
    assert await one == "reply-1" and await two == "reply-1"
    assert runs == ["first"]
    now[0] = 9.9
    assert cache.slot("a").get() == "reply-1"
    now[0] = 20.0
    assert cache.slot("a").get() is None, "forgotten once the window passed"


async def test_dedupe_forgets_a_failed_init_capacity_and_bytes_oldest_first() -> None:
    cache: DedupeCache[int] = DedupeCache(window=60, capacity=3, max_bytes=10_000)

    async def refused() -> int:
        raise RuntimeError("not handled")

    with pytest.raises(RuntimeError):
        await cache.slot("x").get_or_init(refused)

    async def value() -> int:
        return 7

    # Nothing was remembered: the next delivery runs.
    assert await cache.slot("x").get_or_init(value) == 7
    for message_id in ["a", "b", "c", "d", "e"]:
        cache.slot(message_id)
    assert len(cache) <= 3

    cache = DedupeCache(window=60, capacity=100, max_bytes=10_000)
    for n, message_id in enumerate(["a", "b", "c", "d"]):

        async def outcome(n: int = n) -> int:
            return n

        await cache.slot(message_id).get_or_init(outcome)
        cache.charge(message_id, 4_000)
    # 16 000 bytes charged against 10 000: a and b are forgotten, c and d remembered.
    assert cache.bytes == 8_000
    assert cache.slot("c").get() == 2 and cache.slot("d").get() == 3
    assert cache.slot("a").get() is None
    cache.slot("huge")
    cache.charge("huge", 20_000)
    assert cache.slot("huge").get() is None and cache.bytes <= 10_000


def test_capabilities_are_checked_against_the_registry_bounds() -> None:
    Capability("x.tool", "1.0.0", "does x", {"type": "object"}).check()
    for capability, message in [
        (Capability("x", description="d" * 1025), "1025 bytes"),
        (Capability("x", output_schema=[]), "must be a dict or a bool"),  # type: ignore[arg-type]
        (Capability("bad name"), "dotted name"),
        (Capability("x", "1.0"), "semver"),
        (Capability("x", description="a\u202eb"), r"U\+202E"),
        (Capability("x", description="a\x07b"), r"U\+0007"),
    ]:
        with pytest.raises(ValueError, match=message):
            capability.check()
    deep: dict[str, object] = {}
    for _ in range(32):
        deep = {"not": deep}
    with pytest.raises(ValueError, match="33 levels"):
        Capability("x", input_schema=deep).check()
    proto = Capability("x.tool", "1.0.0", "does x", {"type": "object"}).to_proto()
    assert proto.input_schema == '{"type":"object"}' and proto.output_schema == ""


def test_reasons_are_the_ones_docs_errors_md_lists() -> None:
    documented = set(re.findall(r"^### `([A-Z_]+)`", (REPO / "docs/errors.md").read_text(), re.M))
    defined = {value for name, value in vars(Reason).items() if name.isupper()}
    assert defined == documented


def test_errors_round_trip_through_a_call_error_with_their_details() -> None:
    error = ReachError(
        grpc.StatusCode.UNAVAILABLE, "busy", Reason.OVERLOADED, {"retry_after_ms": "50"}, retry_after=0.05
    )
    back = ReachError.from_call_error(error.to_call_error())
    assert (back.code, back.message, back.reason, back.metadata) == (
        grpc.StatusCode.UNAVAILABLE,
        "busy",
        "OVERLOADED",
        {"retry_after_ms": "50"},
    )
    assert back.retry_after == pytest.approx(0.05)
    plain = ReachError.from_call_error(ReachError(grpc.StatusCode.NOT_FOUND, "gone").to_call_error())
    assert plain.reason is None and plain.to_call_error().details == b""


async def test_a_wildcard_listener_needs_an_advertised_host() -> None:
    runtime = AgentRuntime(AgentConfig(service="wild", registry_endpoint="http://127.0.0.1:1"))
    runtime.handle(Capability("wild.echo", "1.0.0"), lambda ctx, message: text_part("x"))
    with pytest.raises(ValueError, match="wildcard address the router cannot dial: set AgentConfig.advertise_host"):
        await runtime.start(host="0.0.0.0")


def test_x_reach_caller_is_believed_only_from_the_routers_certificate() -> None:
    from reach_mesh.trust import router_identity, vouched_caller

    router = router_identity("reach.test")
    routers = (router,)
    alice = {"x-reach-caller": "spiffe://reach.test/operator/alice"}
    assert router == "spiffe://reach.test/router"
    assert vouched_caller(routers, router, alice) == "spiffe://reach.test/operator/alice"
    assert vouched_caller(routers, "spiffe://reach.test/agent/other", alice) is None
    assert vouched_caller(routers, "spiffe://reach.test/rout", alice) is None  # not a prefix match
    assert vouched_caller(routers, None, alice) is None  # a plaintext peer
    assert vouched_caller((), router, alice) is None  # an agent not serving TLS
    assert vouched_caller(routers, router, {}) is None
    assert vouched_caller(routers, router, {"x-reach-caller": "alice"}) is None  # not a SPIFFE ID


def test_an_agent_serving_tls_answers_only_routers_and_health_checks_of_the_registry() -> None:
    from reach_mesh import DirectCallers, Reason

    callers = DirectCallers.of("reach.test")
    router, registry = "spiffe://reach.test/router", "spiffe://reach.test/registry"
    handle, health = "/reach.v1.AgentService/Handle", "/grpc.health.v1.Health/Check"
    reflection = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    for method in (handle, health, reflection, "/reach.v1.AgentService/HandleMux"):
        assert callers.refusal(method, router) is None
    assert callers.refusal(health, registry) is None
    for peer in (registry, "spiffe://reach.test/agent/other", "spiffe://reach.test/operator/admin", None):
        for method in (handle, reflection) if peer == registry else (handle, health, reflection):
            refusal = callers.refusal(method, peer)
            assert refusal is not None, (method, peer)
            assert refusal.code == grpc.StatusCode.PERMISSION_DENIED
            assert refusal.reason == Reason.NOT_AUTHORIZED
            assert refusal.metadata["identity"] == (peer or "anonymous")
            assert router in refusal.message
    custom = DirectCallers.of("reach.test", ["spiffe://reach.test/router-eu"])
    assert custom.refusal(handle, "spiffe://reach.test/router-eu") is None
    assert custom.refusal(handle, router) is not None
    with pytest.raises(ValueError, match="router_identities.*not a SPIFFE ID"):
        DirectCallers.of("reach.test", ["router"])
    with pytest.raises(ValueError, match="probe_identities.*trust domain"):
        DirectCallers.of("reach.test", probes=["spiffe://elsewhere/registry"])


def test_trust_settings_name_what_is_wrong(tmp_path: Path) -> None:
    from reach_mesh import AgentConfig, MeshClient, TlsConfig

    with pytest.raises(ValueError, match=r"agent\.tls\.ca"):
        AgentConfig(service="a", tls=TlsConfig(ca=tmp_path / "missing.pem")).validate()
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here")
    with pytest.raises(ValueError, match="go together"):
        AgentConfig(service="a", tls=TlsConfig(ca=ca, cert=ca)).validate()
    with pytest.raises(ValueError, match="trust_domain"):
        AgentConfig(service="a", trust_domain="not a domain").validate()
    with pytest.raises(ValueError, match="join_token"):
        AgentConfig(service="a", join_token="two words").validate()
    AgentConfig(service="a", tls=TlsConfig(ca=ca), join_token="a.b.c").validate()
    with pytest.raises(ValueError, match="bearer token"):
        MeshClient("http://10.1.2.3:7070", token="a.b.c")
