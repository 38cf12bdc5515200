#!/usr/bin/env python3
"""A tiny OTLP/gRPC trace receiver for tests: one JSON line per received span.

    otlp_receiver.py --port 0 --out spans.jsonl [--blackhole]

Listens on 127.0.0.1, prints ``PORT <n>`` on stdout once bound (so ``--port 0`` works),
then appends to ``--out`` one line per span:
``{"trace_id", "span_id", "parent_span_id", "name", "kind", "attributes", "service.name",
"status_code"}`` with ids as lowercase hex (parent empty for roots) and attribute values as
JSON scalars.

``--blackhole`` accepts connections and requests but never answers them, like a collector
that hangs. Stops on SIGTERM or SIGINT.
"""

import argparse
import json
import signal
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def any_value(value):
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def attributes(kvs):
    return {kv.key: any_value(kv.value) for kv in kvs}


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out_path, blackhole):
        self.out_path = out_path
        self.blackhole = blackhole
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def Export(self, request, context):
        if self.blackhole:
            # Never answer: hold the call until the client gives up or we stop.
            self.stop.wait()
            context.abort(grpc.StatusCode.UNAVAILABLE, "black hole")
        lines = []
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    lines.append(
                        json.dumps(
                            {
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "name": span.name,
                                "kind": span.kind,
                                "attributes": attributes(span.attributes),
                                "service.name": resource.get("service.name"),
                                "resource": resource,
                                "status_code": span.status.code,
                            },
                            sort_keys=True,
                        )
                    )
        with self.lock, open(self.out_path, "a", encoding="utf-8") as out:
            for line in lines:
                out.write(line + "\n")
        return trace_service_pb2.ExportTraceServiceResponse()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4317, help="port on 127.0.0.1; 0 picks one")
    parser.add_argument("--out", required=True, help="file to append span JSON lines to")
    parser.add_argument("--blackhole", action="store_true", help="accept calls, never answer")
    args = parser.parse_args()

    service = TraceService(args.out, args.blackhole)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    if port == 0:
        print(f"cannot bind 127.0.0.1:{args.port}", file=sys.stderr)
        return 1
    server.start()
    print(f"PORT {port}", flush=True)

    done = threading.Event()

    def stop(*_):
        service.stop.set()
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    done.wait()
    server.stop(grace=0.5).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
