#!/usr/bin/env bash
# The protoc that buf.gen.yaml's Python plugins run (`protoc_path`): the one compiled into
# grpcio-tools, from the repository's venv, so generated code matches the grpcio-tools and
# protobuf versions pinned in requirements-dev.txt. Takes protoc's own arguments.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$repo/.venv/bin/python"
if [[ ! -x "$python" ]]; then
    echo "protoc.sh: $python is missing; run scripts/python-env.sh first" >&2
    exit 1
fi
exec "$python" -m grpc_tools.protoc "$@"
