"""A Python agent as a process of its own, for tests that signal it: serves
``<service>.work`` (sleeps ``--delay-ms``, then answers its instance id and the request's data)
until SIGTERM, drains, and prints ``{"handled": N}`` as its last line. Logs go to stdout."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from reach_mesh import AgentConfig, AgentRuntime, HandlerContext, Message, data_part


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--registry", required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--delay-ms", type=int, default=50)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    handled = 0
    runtime = AgentRuntime(
        AgentConfig(service=args.service, registry_endpoint=args.registry, instance_id=args.instance_id, max_drain=10)
    )

    @runtime.handler(f"{args.service}.work", "1.0.0")
    async def work(ctx: HandlerContext, message: Message) -> object:
        nonlocal handled
        await asyncio.sleep(args.delay_ms / 1000)
        handled += 1
        return data_part({"instance": ctx.instance_id, "request": message.data})

    asyncio.run(runtime.run())
    print(json.dumps({"handled": handled}), flush=True)


if __name__ == "__main__":
    main()
