"""Calls a capability through the Reach router with the generated grpcio client alone
(``reach.v1``, committed in sdk/python/src), without the SDK: what any grpcio program can do.
The SDK's MeshClient does the same with trace ids, multiplexing and typed parts.

    .venv/bin/python sdk/python/examples/call_router.py \
        --endpoint 127.0.0.1:7070 --capability complaint.classify --json '{"complaint_id": "1", "narrative": "my PSLF forgiveness was denied"}'

(``reach.v1`` comes with the SDK installed by scripts/python-env.sh; elsewhere set
``PYTHONPATH=sdk/python/src``.) Prints the reply as JSON: the route (instance, trace id) and
the reply's parts; on failure, the status code and message.
"""

import argparse
import json
import sys

import grpc
from google.protobuf import json_format, struct_pb2

from reach.v1 import envelope_pb2, router_service_pb2, router_service_pb2_grpc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default="127.0.0.1:7070", help="router host:port")
    parser.add_argument("--capability", required=True, help="the capability to call")
    parser.add_argument("--text", help="send one text part")
    parser.add_argument("--json", help="send one data part (a JSON object)")
    parser.add_argument("--timeout", type=float, default=10.0, help="deadline in seconds")
    args = parser.parse_args()

    part = envelope_pb2.Part()
    if args.json is not None:
        value = struct_pb2.Value()
        json_format.Parse(args.json, value)
        part.data.CopyFrom(value)
        part.media_type = "application/json"
    else:
        part.text = args.text or ""
        part.media_type = "text/plain"
    message = envelope_pb2.ReachMessage(
        header=envelope_pb2.Header(capability=args.capability, source="python.example"),
        payload=envelope_pb2.Payload(type="python.request", parts=[part]),
    )
    with grpc.insecure_channel(args.endpoint) as channel:
        router = router_service_pb2_grpc.RouterServiceStub(channel)
        try:
            reply = router.Call(router_service_pb2.CallRequest(message=message), timeout=args.timeout)
        except grpc.RpcError as error:
            print(json.dumps({"code": error.code().name, "message": error.details()}))
            return 1
    print(json_format.MessageToJson(reply, preserving_proto_field_name=True, indent=None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
