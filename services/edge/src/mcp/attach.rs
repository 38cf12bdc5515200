//! An MCP server attached to the mesh (built next).
