"""Python MeshClient throughput and latency through the router: unary ``Call`` against
multiplexed ``CallMux``, side by side, at a few concurrencies, in one run.

The agent is the Rust example coordinator of ``reach dev`` (``complaint.classify``, the rules
classifier: microseconds of work), so the figures measure the client, the router hop and the
transport, not the agent. The script starts its own ``reach dev`` on a free 127.0.0.1 port
(``--reach``, default ``$REACH_BIN`` or ``target/debug/reach``; build it with ``--release`` for
figures worth comparing) and stops it at the end; or give ``--endpoint`` of a running one.

    .venv/bin/python sdk/python/benchmarks/bench_client.py --reach target/release/reach

Each cell runs ``--seconds`` (after ``--warmup``) with N callers, each sending its next call
when its last one returned, all on one client (one channel; one CallMux stream when
multiplexed). Prints calls/s and p50/p99 latency per path and the mux/unary throughput ratio.
Bounded: at most (warmup + seconds) x 2 x len(concurrencies) plus start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reach_mesh import CallOptions, MeshClient, data_part

REPO = Path(__file__).resolve().parents[3]
CAPABILITY = "complaint.classify"
COMPLAINT = {"complaint_id": "bench", "narrative": "my autopay was misapplied and I was charged a late fee"}


async def run_cell(endpoint: str, multiplex: bool, concurrency: int, warmup: float, seconds: float) -> tuple[float, float, float]:
    """Calls/s, p50 and p99 latency (ms) of ``concurrency`` closed-loop callers."""
    async with MeshClient(endpoint, "bench.client", multiplex=multiplex) as mesh:
        content = data_part(COMPLAINT)
        options = CallOptions(timeout=10)
        await mesh.call(CAPABILITY, content, options)  # connect (and open the stream)
        latencies: list[float] = []
        start = time.perf_counter()
        measure_from = start + warmup
        stop_at = measure_from + seconds

        async def caller() -> None:
            while True:
                sent = time.perf_counter()
                if sent >= stop_at:
                    return
                await mesh.call(CAPABILITY, content, options)
                done = time.perf_counter()
                if sent >= measure_from:
                    latencies.append(done - sent)

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        if multiplex and mesh.mux_streams_opened != 1:
            raise SystemExit(f"expected one CallMux stream, the client opened {mesh.mux_streams_opened}")
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return len(latencies) / seconds, statistics.median(latencies) * 1e3, p99 * 1e3


def start_reach(binary: str, workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen(
        [binary, "dev", "--listen", "127.0.0.1:0", "--admin-listen", "", "--edge-listen", "", "--data-dir", f"{workdir}/data"],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "REACH_LOG": "error"},
    )
    assert process.stdout is not None
    deadline = time.monotonic() + 20
    seen = b""
    while time.monotonic() < deadline:
        seen += process.stdout.readline()
        match = re.search(rb"grpc\s+(http://127\.0\.0\.1:\d+)", seen)
        if match:
            return process, match.group(1).decode()
    process.kill()
    raise SystemExit(f"reach dev did not start: {seen.decode(errors='replace')}")


async def wait_routable(endpoint: str) -> None:
    async with MeshClient(endpoint, "bench.wait") as mesh:
        deadline = time.monotonic() + 20
        while True:
            try:
                await mesh.call(CAPABILITY, data_part(COMPLAINT), CallOptions(timeout=2))
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)


async def bench(endpoint: str, concurrencies: list[int], warmup: float, seconds: float) -> None:
    await wait_routable(endpoint)
    print(f"Python MeshClient -> router -> Rust {CAPABILITY} ({endpoint}), {seconds:g}s per cell")
    print(f"{'callers':>7} | {'unary calls/s':>13} {'p50 ms':>7} {'p99 ms':>7} | {'mux calls/s':>11} {'p50 ms':>7} {'p99 ms':>7} | {'mux/unary':>9}")
    for concurrency in concurrencies:
        unary = await run_cell(endpoint, False, concurrency, warmup, seconds)
        mux = await run_cell(endpoint, True, concurrency, warmup, seconds)
        print(
            f"{concurrency:>7} | {unary[0]:>13.0f} {unary[1]:>7.2f} {unary[2]:>7.2f} | "
            f"{mux[0]:>11.0f} {mux[1]:>7.2f} {mux[2]:>7.2f} | {mux[0] / unary[0]:>8.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reach", default=os.environ.get("REACH_BIN", str(REPO / "target/debug/reach")))
    parser.add_argument("--endpoint", help="a running reach dev (with its example agents) instead of starting one")
    parser.add_argument("--concurrency", default="1,8,64", help="comma-separated caller counts")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per cell")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured time before each cell")
    args = parser.parse_args()
    concurrencies = [int(n) for n in args.concurrency.split(",")]
    if args.endpoint:
        asyncio.run(bench(args.endpoint, concurrencies, args.warmup, args.seconds))
        return
    with tempfile.TemporaryDirectory(prefix="reach-bench-") as workdir:
        process, endpoint = start_reach(args.reach, workdir)
        try:
            asyncio.run(bench(endpoint, concurrencies, args.warmup, args.seconds))
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


if __name__ == "__main__":
    sys.exit(main())
