"""An MCP client of the Reach mesh, written with the official MCP SDK (the ``mcp`` package)
alone — it knows nothing of Reach. Against ``reach dev`` (docs/edges.md):

    .venv/bin/python sdk/python/examples/mcp_client.py
    .venv/bin/python sdk/python/examples/mcp_client.py --url http://127.0.0.1:7072/mcp

It lists the mesh's tools (its capabilities, with their schemas), then calls
``complaint.triage`` about one complaint and prints the structured result, then shows what a
model gets back for arguments that do not fit the tool's schema.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from mcp import Client

COMPLAINT = {
    "complaint_id": "example-1",
    "narrative": "I was charged a late fee although my autopay payment was set up",
    "company": "Acme Mortgage",
    "state": "CA",
}


async def main(url: str) -> None:
    async with Client(url) as client:
        # Every page of the listing (200 tools a page).
        tools, cursor = [], None
        while True:
            page = await client.list_tools(cursor=cursor)
            tools.extend(page.tools)
            if not (cursor := page.next_cursor):
                break
        print(f"{len(tools)} tools at {url}:")
        for tool in tools:
            arguments = ", ".join(tool.input_schema.get("properties", {}))
            print(f"  {tool.name}({arguments}): {tool.description}")

        result = await client.call_tool("complaint.triage", COMPLAINT)
        print("complaint.triage answered:")
        print(" ", json.dumps(result.structured_content))

        wrong = await client.call_tool("complaint.triage", {**COMPLAINT, "narrative": 5})
        print(f"with a number for the narrative (is_error={wrong.is_error}):")
        print(" ", wrong.content[0].text)  # type: ignore[union-attr]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:7072/mcp", help="the MCP endpoint reach dev prints")
    asyncio.run(main(parser.parse_args().url))
