#!/usr/bin/env bash
# Installs what the registry's etcd backend needs to build and test, with apt-get when missing
# (idempotent): etcd 3.4 (etcd-server: the tests start their own etcd on ephemeral ports) and
# protoc (protobuf-compiler: the etcd-client crate compiles etcd's protos in its build
# script). Prints one line to stdout: export PROTOC=/path/to/protoc.
set -euo pipefail
need=()
command -v etcd >/dev/null || need+=(etcd-server)
command -v protoc >/dev/null || need+=(protobuf-compiler)
# etcd's protos import protobuf's well-known types (google/protobuf/*.proto).
[[ -f /usr/include/google/protobuf/descriptor.proto ]] || need+=(libprotobuf-dev)
if ((${#need[@]})); then
    echo "installing ${need[*]} (apt-get)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    # etcd-server's package would start a system etcd on 2379: policy-rc.d forbids it.
    policy=/usr/sbin/policy-rc.d
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod +x "$policy"
        trap 'rm -f "$policy"' EXIT
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi
echo "etcd $(etcd --version | head -1 | awk '{print $3}'), $(protoc --version)" >&2
echo "export PROTOC=$(command -v protoc)"
