"""The MCP edge of ``reach dev`` (``/mcp`` on the edge's HTTP port), end to end, through the
official MCP SDK's client (the ``mcp`` package, protocol revision 2026-07-28, Streamable
HTTP): the mesh's capabilities listed as tools with their schemas, a tool call routed to an
example agent with structured content and the caller's trace continued, schema-invalid
arguments answered with the JSON pointer of each bad field, unknown tools refused, requests
served statelessly, and the transport's DNS-rebinding and Origin defences.

One ``reach dev`` with the example agents serves the module: they take seconds to start."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from conftest import REPO, START_TIMEOUT, ReachProcess

#: The example agents' capabilities (every one declares an input schema in
#: examples/protocol-registry.yaml), once all are up.
EXPECTED_TOOLS = {
    "complaint.classify",
    "complaint.credit_report",
    "complaint.ingest",
    "complaint.origination",
    "complaint.repayment",
    "complaint.servicing",
    "complaint.triage",
    # The stdio server the module's reach dev attaches (sdk/python/tests/mcp_servers/words.py).
    "mcp.words.count_words",
    "mcp.words.shout",
}
COMPLAINT = {
    "complaint_id": "mcp-1",
    "narrative": "I was charged a late fee although my autopay payment was set up",
    "company": "Acme Mortgage",
    "state": "CA",
}
#: The protocol headers of a raw Streamable HTTP request (what the SDK sends).
MCP_HEADERS = {
    "accept": "application/json, text/event-stream",
    "content-type": "application/json",
    "mcp-protocol-version": "2026-07-28",
}


def raw_request(method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """A stateless JSON-RPC request as the 2026-07-28 revision has every request carry it:
    the protocol version and client capabilities in ``_meta``."""
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": {**(params or {}), "_meta": meta}}


class McpProcess(ReachProcess):
    """``reach dev`` whose banner's ``mcp`` line gives the MCP endpoint (:attr:`mcp_url`,
    ``http://127.0.0.1:PORT/mcp``)."""

    banner_lines = {"mcp": rb"mcp\s+(https?://127\.0\.0\.1:\d+/mcp)\s"}

    @property
    def mcp_url(self) -> str:
        return self.banner_values["mcp"]


async def _tool_names(url: str) -> set[str]:
    async with Client(url) as client:
        return {tool.name for tool in (await client.list_tools()).tools}


@pytest.fixture(scope="module")
def mesh() -> Iterator[McpProcess]:
    """``reach dev`` with the example agents and the stdio MCP server ``words.py`` attached
    (``[[mcp.attach]]``), its edge on an ephemeral port, waited for until every example
    capability and attached tool is a tool."""
    with tempfile.TemporaryDirectory(prefix="reach-mcp-") as tmp:
        root = Path(tmp)
        words = REPO / "sdk/python/tests/mcp_servers/words.py"
        (root / "reach.toml").write_text(f"[[mcp.attach]]\nname = \"words\"\ncommand = {json.dumps([sys.executable, str(words)])}\n")
        process = McpProcess(
            [
                "dev", "--config", str(root / "reach.toml"), "--listen", "127.0.0.1:0", "--admin-listen", "",
                "--edge-listen", "127.0.0.1:0", "--data-dir", str(root / "data"),
            ],
            cwd=REPO,
            log=root / "reach-dev.log",
        )
        try:
            deadline = time.monotonic() + 30
            names: set[str] | Exception = set()
            while time.monotonic() < deadline:
                try:
                    names = asyncio.run(_tool_names(process.mcp_url))
                    if EXPECTED_TOOLS <= names:
                        break
                except Exception as error:  # noqa: BLE001 - the edge may not answer yet
                    names = error
                time.sleep(0.1)
            else:
                pytest.fail(f"the MCP edge did not list {sorted(EXPECTED_TOOLS)} within 30s (last: {names!r})", pytrace=False)
            yield process
        finally:
            process.stop()


async def test_tools_are_the_capabilities_sorted_with_their_descriptions_and_schemas(mesh: McpProcess) -> None:
    async with Client(mesh.mcp_url) as client:
        listed = (await client.list_tools()).tools
        again = (await client.list_tools()).tools
    names = [tool.name for tool in listed]
    assert names == sorted(names), "tools/list is ordered by name"
    assert [t.model_dump() for t in listed] == [t.model_dump() for t in again], "the listing is deterministic"
    assert EXPECTED_TOOLS <= set(names)
    classify = next(tool for tool in listed if tool.name == "complaint.classify")
    assert classify.description == "classify a complaint narrative into a servicing category"
    assert classify.input_schema["type"] == "object"
    assert classify.input_schema["required"] == ["complaint_id"]
    assert classify.input_schema["properties"]["narrative"] == {"type": "string"}
    # The protocol registry declares complaint.classify idempotent.
    assert classify.annotations is not None and classify.annotations.idempotent_hint is True


async def test_a_tool_call_is_a_routed_call_with_structured_content_in_the_callers_trace(mesh: McpProcess) -> None:
    trace_id = os.urandom(16).hex()
    traceparent = f"00-{trace_id}-{os.urandom(8).hex()}-01"
    async with Client(mesh.mcp_url) as client:
        result = await client.call_tool("complaint.classify", COMPLAINT, meta={"traceparent": traceparent})
    assert result.is_error is False
    structured = result.structured_content
    assert structured is not None
    assert structured["category"] == "servicing"
    assert structured["confidence"] == 1
    # The text rendering is the same JSON, for clients that read only text.
    assert json.loads(result.content[0].text) == structured  # type: ignore[union-attr]
    assert result.meta is not None
    assert result.meta["reach.traceId"] == trace_id, "the call continues the caller's trace"
    assert result.meta["reach.instanceId"].startswith("coordinator")


async def test_schema_invalid_arguments_are_a_tool_error_naming_the_bad_fields(mesh: McpProcess) -> None:
    async with Client(mesh.mcp_url) as client:
        wrong_type = await client.call_tool("complaint.classify", {**COMPLAINT, "narrative": 5})
        missing = await client.call_tool("complaint.classify", {"narrative": "no id"})
    assert wrong_type.is_error is True
    text = wrong_type.content[0].text  # type: ignore[union-attr]
    assert '/narrative: 5 is not of type "string"' in text, text
    assert missing.is_error is True
    text = missing.content[0].text  # type: ignore[union-attr]
    assert "/complaint_id" in text and "missing" in text, text


async def test_an_unknown_tool_is_a_protocol_error(mesh: McpProcess) -> None:
    async with Client(mesh.mcp_url) as client:
        for name in ["complaint.nothing", "not a tool name"]:
            with pytest.raises(MCPError) as raised:
                await client.call_tool(name, {})
            assert raised.value.error.code == -32602, raised.value.error
            assert "tools/list" in raised.value.error.message


async def test_requests_are_served_without_a_session(mesh: McpProcess) -> None:
    """Stateless (2026-07-28): a request needs no initialize and no session id, so any edge
    replica can answer it."""
    request = raw_request("tools/call", {"name": "complaint.classify", "arguments": COMPLAINT})
    async with httpx.AsyncClient(timeout=30) as http:
        headers = {**MCP_HEADERS, "mcp-method": "tools/call", "mcp-name": "complaint.classify"}
        response = await http.post(mesh.mcp_url, json=request, headers=headers)
    assert response.status_code == 200, response.text
    assert "mcp-session-id" not in response.headers
    body = response.json()
    assert body["id"] == 1
    assert body["result"]["structuredContent"]["category"] == "servicing"


async def test_foreign_hosts_and_origins_are_refused(mesh: McpProcess) -> None:
    """The transport spec's defences: a `Host` the edge is not served as (DNS rebinding), a
    browser `Origin` not allowed and a body that is not JSON are refused before any tool
    runs."""
    request = raw_request("tools/list")
    headers = {**MCP_HEADERS, "mcp-method": "tools/list"}
    async with httpx.AsyncClient(timeout=10) as http:
        served = await http.post(mesh.mcp_url, json=request, headers=headers)
        rebound = await http.post(mesh.mcp_url, json=request, headers={**headers, "host": "evil.example.com"})
        cross_site = await http.post(mesh.mcp_url, json=request, headers={**headers, "origin": "https://evil.example.com"})
        plain_text = await http.post(mesh.mcp_url, content=json.dumps(request), headers={**headers, "content-type": "text/plain"})
    assert served.status_code == 200, served.text
    assert plain_text.status_code == 415, plain_text.text
    assert rebound.status_code == 403, rebound.text
    assert cross_site.status_code == 403, cross_site.text


async def test_the_protected_resource_metadata_names_the_endpoint(mesh: McpProcess) -> None:
    base = mesh.mcp_url.removesuffix("/mcp")
    async with httpx.AsyncClient(timeout=10) as http:
        for path in ["/.well-known/oauth-protected-resource/mcp", "/.well-known/oauth-protected-resource"]:
            response = await http.get(base + path)
            assert response.status_code == 200, (path, response.text)
            document = response.json()
            assert document["resource"] == mesh.mcp_url
            assert document["bearer_methods_supported"] == ["header"]


async def test_the_documented_example_client_runs(mesh: McpProcess) -> None:
    """``sdk/python/examples/mcp_client.py`` (docs/edges.md) against the mesh."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPO / "sdk/python/examples/mcp_client.py"),
        "--url",
        mesh.mcp_url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(child.communicate(), timeout=60)
    text = out.decode(errors="replace")
    assert child.returncode == 0, text
    assert "complaint.classify(company, complaint_id, narrative, state): classify a complaint" in text, text
    assert '"status": "routed"' in text, text
    assert '/narrative: 5 is not of type "string"' in text, text


async def test_an_attached_mcp_servers_tool_is_a_tool_of_the_edge(mesh: McpProcess) -> None:
    """An MCP server brought into the mesh (``reach mcp attach``, here by ``reach dev``'s
    ``[[mcp.attach]]``) is reached through the MCP edge like any capability: its tool's
    description and schema, and its answer, routed through the mesh."""
    async with Client(mesh.mcp_url) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        count = tools["mcp.words.count_words"]
        result = await client.call_tool("mcp.words.count_words", {"text": "the quick brown fox"})
        wrong = await client.call_tool("mcp.words.count_words", {"text": 7})
    assert count.description == "Counts the words and characters of a text."
    assert count.input_schema["required"] == ["text"]
    assert result.is_error is False
    assert result.structured_content == {"words": 4, "characters": 19}
    assert result.meta is not None and result.meta["reach.instanceId"].startswith("mcp.words")
    assert wrong.is_error is True
    assert '/text: 7 is not of type "string"' in wrong.content[0].text  # type: ignore[union-attr]


async def test_malformed_requests_get_json_rpc_errors_saying_what_to_fix(mesh: McpProcess) -> None:
    headers = {**MCP_HEADERS, "mcp-method": "tools/call", "mcp-name": "complaint.classify"}
    not_an_object = raw_request("tools/call", {"name": "complaint.classify", "arguments": "hello"})
    async with httpx.AsyncClient(timeout=10) as http:
        garbage = await http.post(mesh.mcp_url, content="{not json", headers=headers)
        batch = await http.post(mesh.mcp_url, content="[]", headers=headers)
        bad_params = await http.post(mesh.mcp_url, json=not_an_object, headers=headers)
    for response in (garbage, batch):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == -32700, response.text
        assert "not one JSON-RPC 2.0 request" in response.json()["error"]["message"]
    assert bad_params.status_code == 400, bad_params.text
    error = bad_params.json()["error"]
    assert error["code"] == -32602, error
    assert '"arguments" a JSON object' in error["message"], error
    assert bad_params.json()["id"] == 1
