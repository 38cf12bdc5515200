"""A small MCP server over stdio, written with the official `mcp` package: the kind of server a
user already runs and attaches to the mesh with `reach mcp attach`."""

from mcp.server.mcpserver import MCPServer

server = MCPServer("words")


@server.tool()
def count_words(text: str) -> dict[str, int]:
    """Counts the words and characters of a text."""
    return {"words": len(text.split()), "characters": len(text)}


@server.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


if __name__ == "__main__":
    server.run("stdio")
