"""An MCP server whose tool list changes, written with the official `mcp` package: calling
`enable_extra` adds the tool `extra` and sends `notifications/tools/list_changed`; `fail`
always fails (a tool error, `isError: true`); `exit_now` exits the process; `slow` sleeps;
`spaced out` has a name no capability can have.

Runs over stdio by default; `--http` serves Streamable HTTP on 127.0.0.1 at an ephemeral port
and prints `http://127.0.0.1:PORT/mcp` on its first line of stdout once it listens."""

import os
import socket
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("changing")


@server.tool()
def echo(text: str) -> dict[str, str]:
    """Echoes the text."""
    return {"text": text}


@server.tool()
def fail(reason: str) -> str:
    """Always fails, with the reason given."""
    raise ToolError(f"refused: {reason}")


@server.tool()
def exit_now(code: int) -> str:
    """Exits the server process at once with the exit code given (a server that goes away)."""
    os._exit(code)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleeps for the seconds given, then answers."""
    import anyio

    await anyio.sleep(seconds)
    return "awake"


def spaced(text: str) -> str:
    """A tool whose name (`spaced out`) cannot be a capability: the attachment skips it."""
    return text


server.add_tool(spaced, name="spaced out")


def extra(n: int) -> dict[str, int]:
    """Doubles n (added by enable_extra)."""
    return {"doubled": n * 2}


@server.tool()
async def enable_extra(ctx: Context) -> str:
    """Adds the tool `extra` and tells the client the tool list changed."""
    server.add_tool(extra, name="extra")
    await ctx.session.send_tool_list_changed()
    return "extra enabled"


def serve_http() -> None:
    import anyio
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    app = server.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    config = uvicorn.Config(app, log_level="warning")
    print(f"http://127.0.0.1:{port}/mcp", flush=True)
    anyio.run(lambda: uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    if "--http" in sys.argv:
        serve_http()
    else:
        server.run("stdio")
