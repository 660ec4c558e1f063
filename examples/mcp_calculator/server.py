"""A calculator served over MCP (stdio), written with the mcp SDK: posttrain starts it with --mcp-server."""

try:  # mcp 2
    from mcp.server.mcpserver import MCPServer as Server
except ImportError:  # mcp 1
    from mcp.server.fastmcp import FastMCP as Server

server = Server("calculator")


@server.tool()
def calc(expression: str) -> str:
    """The sum A+B of two whole numbers."""
    a, b = expression.split("+")
    return str(int(a) + int(b))


if __name__ == "__main__":
    server.run()
