"""A protoc plugin (stdin: CodeGeneratorRequest, stdout: CodeGeneratorResponse) that generates
gRPC Python stubs (``*_pb2_grpc.py``) with the generator compiled into grpcio-tools.

grpcio-tools ships its gRPC Python generator inside its own protoc (``--grpc_python_out``),
not as a ``protoc-gen-grpc_python`` binary, and buf accepts only protoc's own generators as
``protoc_builtin`` plugins. This plugin bridges the two the way buf runs built-ins: it hands
the request's descriptors to ``python -m grpc_tools.protoc --descriptor_set_in=/dev/stdin``
and returns the files it wrote. buf.gen.yaml runs it with the repository venv's Python:

    - local: [.venv/bin/python, scripts/protoc-gen-grpc_python.py]

A plugin parameter (``opt`` in buf.gen.yaml) is passed on as ``--grpc_python_opt``.
"""

import pathlib
import subprocess
import sys
import tempfile

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2


def generate(request: plugin_pb2.CodeGeneratorRequest) -> plugin_pb2.CodeGeneratorResponse:
    """Runs grpcio-tools' protoc on the request's files; a protoc failure becomes the
    response's ``error`` (protoc's message), which buf reports."""
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
    )
    descriptors = descriptor_pb2.FileDescriptorSet(file=request.proto_file)
    with tempfile.TemporaryDirectory(prefix="grpc-python-") as out:
        command = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "--descriptor_set_in=/dev/stdin",
            f"--grpc_python_out={out}",
        ]
        if request.parameter:
            command.append(f"--grpc_python_opt={request.parameter}")
        command.extend(request.file_to_generate)
        done = subprocess.run(
            command, input=descriptors.SerializeToString(), capture_output=True, check=False
        )
        if done.returncode != 0:
            response.error = done.stderr.decode(errors="replace").strip() or (
                f"grpc_tools.protoc exited with status {done.returncode}"
            )
            return response
        root = pathlib.Path(out)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                response.file.add(
                    name=path.relative_to(root).as_posix(), content=path.read_text()
                )
    return response


def main() -> None:
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    sys.stdout.buffer.write(generate(request).SerializeToString())


if __name__ == "__main__":
    main()
