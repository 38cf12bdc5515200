#!/usr/bin/env bash
# Builds the container image from deploy/Dockerfile and checks that it runs, on a machine that
# reaches no container registry (CI): Debian's archive and crates.io are all it needs.
#
#   1. bases: the Dockerfile's public bases cannot be pulled, so local stand-ins are made from
#      Debian's archive with debootstrap --variant=minbase bookworm (what debian:bookworm-slim
#      is) and imported: a runtime base, and a builder base that adds gcc, libc6-dev, protoc and CA
#      certificates plus this machine's Rust toolchain (Debian's rustc is older than the
#      workspace's rust-version). The toolchain is copied from `rustc --print sysroot` (a
#      rustup toolchain is self-contained: rustc finds its libraries relative to its own
#      path), without its documentation. Both are kept and reused while their recipe holds.
#   2. build: buildah builds deploy/Dockerfile against them (--build-arg BUILDER_IMAGE /
#      RUNTIME_IMAGE), storage driver vfs, chroot isolation; the Dockerfile's cache mounts
#      (cargo registry, target) make later builds incremental.
#   3. checks: the image's entrypoint, user and lack of HEALTHCHECK; `reach --version`;
#      `reach demo` (the whole mesh in one process, on the examples the image carries); then
#      the image's default command, `reach dev`, with its ports published, probed from the
#      host: grpc.health.v1 for the server and each service, the admin port's /health, /ready
#      and /metrics, the example agents registered and a call routed through them; then SIGTERM
#      and a clean exit.
#
# The container runs under `podman run`, with the constraints the helm chart sets (read-only
# root filesystem, every capability dropped, no new privileges, the non-root user). Two
# settings make podman work in sandboxes such as this project's CI machine and change nothing
# elsewhere: runc instead of crun (crun 1.8 refuses a hybrid cgroup layout, v1 controllers
# beside a v2 hierarchy: "cgroups in hybrid mode not supported, drop all controllers from
# cgroupv2"), and explicit ulimits within this shell's and podman's own (podman's defaults for
# root, nofile 1048576, are above the hard limit, and raising it needs CAP_SYS_RESOURCE, which
# the sandbox withholds: "crun: setrlimit RLIMIT_NOFILE: Operation not permitted").
#
# Idempotent (bases are reused, containers it started are removed on exit, whatever
# happens), bounded (every step under `timeout`), prints a timing per step. Root only (apt,
# debootstrap, rootful buildah). Options:
#   --rebuild-bases   make the base images again (e.g. after a Debian point release)
#   --clean           remove everything this script stored (images, caches) and exit
# Environment: REACH_IMAGE_WORK (default /var/tmp/reach-image: rootfs trees, the .deb cache and
# the container storage), REACH_IMAGE (default localhost/reach:ci), DEBIAN_MIRROR. The build's
# cache mounts live where buildah keeps them, /var/tmp/buildah-cache/reach-* (1.5 GB).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

work="${REACH_IMAGE_WORK:-/var/tmp/reach-image}"
image="${REACH_IMAGE:-localhost/reach:ci}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
suite=bookworm
# Raise it when the way a base is made changes, so existing bases are not reused.
recipe=3

rebuild_bases=false
case "${1:-}" in
    "") ;;
    --rebuild-bases) rebuild_bases=true ;;
    --clean) clean=true ;;
    *) echo "usage: scripts/image.sh [--rebuild-bases | --clean]" >&2; exit 64 ;;
esac

if [[ $EUID -ne 0 ]]; then
    echo "image: run as root (apt-get, debootstrap and rootful buildah/podman)" >&2
    exit 1
fi

# Our own container storage, so this script neither meets another storage driver's
# configuration in /var/lib/containers nor leaves anything behind there.
storage=(--root "$work/storage" --runroot "$work/run" --storage-driver vfs)
buildah_cmd=(buildah "${storage[@]}")
podman_cmd=(podman "${storage[@]}" --runtime runc --cgroup-manager cgroupfs --events-backend file)
bah() { "${buildah_cmd[@]}" "$@"; }
pod() { "${podman_cmd[@]}" "$@"; }

start_all=$(date +%s)
step_start=$start_all
timings=()
step() {
    echo "== image: $*"
    step_start=$(date +%s)
}
done_step() {
    local took=$(($(date +%s) - step_start))
    timings+=("$(printf '%-34s %4ss' "$1" "$took")")
    echo "   ($1: ${took}s)"
}

if [[ "${clean:-false}" == true ]]; then
    bah rm --all >/dev/null 2>&1 || true
    bah rmi --all --force >/dev/null 2>&1 || true
    # The Dockerfile's cache mounts (by their ids), where buildah keeps them.
    rm -rf "$work" /var/tmp/buildah-cache/reach-cargo-registry /var/tmp/buildah-cache/reach-target
    echo "image: removed $work and the build caches"
    exit 0
fi

# --- tools -------------------------------------------------------------------------------------
step "tools"
need=()
command -v buildah >/dev/null || need+=(buildah)
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v curl >/dev/null || need+=(curl)
if ((${#need[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq "${need[@]}" >/dev/null
fi
"$repo/scripts/python-env.sh" >/dev/null
grpcurl="$repo/.venv/bin/grpcurl"
command -v rustc >/dev/null || { echo "image: no rustc on PATH; the builder base copies this machine's toolchain" >&2; exit 1; }
mkdir -p "$work"
done_step tools

# --- bases -------------------------------------------------------------------------------------
sysroot="$(rustc --print sysroot)"
rust_version="$(rustc --version | cut -d' ' -f2)"
runtime_base="localhost/reach-base/runtime:$suite-r$recipe"
builder_base="localhost/reach-base/builder:$suite-rust$rust_version-r$recipe"
has_image() { bah inspect --type image "$1" >/dev/null 2>&1; }

if $rebuild_bases; then
    bah rmi --force "$runtime_base" "$builder_base" >/dev/null 2>&1 || true
fi

# Runs debootstrap into $work/$1 (a fresh tree) with the packages $2 (comma-separated) on top
# of minbase, sharing one .deb cache between runs.
bootstrap() {
    local tree="$work/$1"
    rm -rf "$tree"
    mkdir -p "$work/debs"
    timeout 600 debootstrap --variant=minbase --cache-dir="$work/debs" \
        ${2:+--include="$2"} "$suite" "$tree" "$mirror" >"$work/$1.log" 2>&1 || {
        tail -20 "$work/$1.log" >&2
        echo "image: debootstrap failed (log: $work/$1.log)" >&2
        exit 1
    }
    # As debian:bookworm-slim: no package lists, caches, documentation or translations.
    rm -rf "$tree"/var/lib/apt/lists/* "$tree"/var/cache/apt/* "$tree"/var/log/* \
        "$tree"/usr/share/doc/* "$tree"/usr/share/man/* "$tree"/usr/share/info/* \
        "$tree"/usr/share/locale/*
}

# Imports the tree $work/$1 as image $2, PATH prefixed with $3, with the further `--change`
# instructions given after it; the tree is removed once imported.
import_tree() {
    local tree="$work/$1" name="$2" path_prefix="$3"
    shift 3
    tar -C "$tree" --numeric-owner -c . |
        pod import --quiet --change "ENV PATH=${path_prefix}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
            "$@" - "$name" >/dev/null
    rm -rf "$tree"
}

if has_image "$runtime_base"; then
    echo "== image: runtime base $runtime_base (kept)"
else
    step "runtime base: debootstrap --variant=minbase $suite"
    bootstrap runtime ""
    import_tree runtime "$runtime_base" ""
    done_step "runtime base (debootstrap)"
fi

if has_image "$builder_base"; then
    echo "== image: builder base $builder_base (kept)"
else
    step "builder base: minbase + gcc, libc6-dev, ca-certificates, protobuf-compiler + rust $rust_version"
    bootstrap builder "gcc,libc6-dev,ca-certificates,protobuf-compiler,libprotobuf-dev"
    install -d "$work/builder/usr/local/rust" "$work/builder/usr/local/cargo"
    # This machine's trust store, so cargo reaches crates.io wherever the host does (through
    # a TLS-inspecting egress proxy, for one, whose CA the host trusts and Debian does not).
    cp -L /etc/ssl/certs/ca-certificates.crt "$work/builder/etc/ssl/certs/ca-certificates.crt"
    for part in bin lib libexec; do
        if [[ -d "$sysroot/$part" ]]; then
            cp -a "$sysroot/$part" "$work/builder/usr/local/rust/"
        fi
    done
    import_tree builder "$builder_base" "/usr/local/cargo/bin:/usr/local/rust/bin:" \
        --change "ENV CARGO_HOME=/usr/local/cargo"
    done_step "builder base (debootstrap + rust)"
fi

# --- build -------------------------------------------------------------------------------------
step "build deploy/Dockerfile (release) -> $image"
old_image_id="$(bah inspect --type image --format '{{.FromImageID}}' "$image" 2>/dev/null || true)"
timeout 1800 "${buildah_cmd[@]}" build \
    --isolation chroot --network host --pull=never \
    --build-arg BUILDER_IMAGE="$builder_base" \
    --build-arg RUNTIME_IMAGE="$runtime_base" \
    -f deploy/Dockerfile -t "$image" . >"$work/build.log" 2>&1 || {
    tail -40 "$work/build.log" >&2
    echo "image: build failed (log: $work/build.log)" >&2
    exit 1
}
grep -E '^ *(Compiling reach |Finished )' "$work/build.log" | sed 's/^/   /' || true
new_image_id="$(bah inspect --type image --format '{{.FromImageID}}' "$image")"
if [[ -n "$old_image_id" && "$old_image_id" != "$new_image_id" ]]; then
    bah rmi "$old_image_id" >/dev/null 2>&1 || true
fi
# Dangling images of earlier builds (the builder stage) are not needed.
bah rmi --prune >/dev/null 2>&1 || true
done_step "build (release, in the container)"

# --- checks ------------------------------------------------------------------------------------
step "checks"
containers=()
cleanup() {
    for c in "${containers[@]}"; do
        pod rm --force --time 0 "$c" >/dev/null 2>&1 || true
    done
    rm -rf "$work/check-data"
}
trap cleanup EXIT

fail() {
    echo "image: check failed: $*" >&2
    for c in "${containers[@]}"; do
        echo "--- logs of $c" >&2
        pod logs "$c" 2>&1 | tail -30 >&2 || true
    done
    exit 1
}

# What the helm chart enforces: read-only root, no capabilities, no privilege gain; and
# ulimits this machine can grant (see the header).
run_opts=(
    --read-only --cap-drop ALL --security-opt no-new-privileges
    --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=4096:4096
)

bah inspect --type image "$image" >"$work/inspect.json" || fail "buildah inspect $image"
python3 - "$work/inspect.json" <<'EOF_PY' || fail "image config"
import json, sys
config = json.load(open(sys.argv[1]))["OCIv1"]["config"]
problems = []
if config.get("Entrypoint") != ["reach"]:
    problems.append(f"entrypoint {config.get('Entrypoint')}, want [\"reach\"]")
user = config.get("User", "")
if user.split(":")[0] in ("", "0", "root"):
    problems.append(f"user {user!r} is root")
if "Healthcheck" in config:
    problems.append("a HEALTHCHECK is set (Kubernetes probes do that)")
if problems:
    sys.exit("; ".join(problems))
print(f"   config: entrypoint {config['Entrypoint']}, cmd {' '.join(config.get('Cmd', []))}, user {user}, no healthcheck")
EOF_PY

version="$(timeout 60 "${podman_cmd[@]}" run --rm "${run_opts[@]}" "$image" --version)" ||
    fail "reach --version"
[[ "$version" == reach\ * ]] || fail "reach --version printed: $version"
echo "   $version"

# The main job inside the image: the examples are where `reach demo` looks for them.
demo="$(timeout 120 "${podman_cmd[@]}" run --rm "${run_opts[@]}" "$image" demo --json)" ||
    fail "reach demo"
python3 - "$demo" <<'EOF_PY' ||
import json, sys
report = json.loads(sys.argv[1])
if not report["total"] or report["failed"]:
    sys.exit(f"{report['failed']} of {report['total']} complaints failed")
print(f"   reach demo: {report['total']} complaints, none failed")
EOF_PY
    fail "reach demo reported failures"

# Free ports on the host for the container's 7070 (gRPC) and 7071 (admin).
read -r grpc_port admin_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
name="reach-image-check-$$"
containers+=("$name")
# Its data directory, owned by the image's user as an emptyDir with fsGroup would be.
data="$work/check-data"
rm -rf "$data"
install -d -o 65532 -g 65532 -m 0700 "$data"
# The image as `docker run -p` runs it: its own CMD (`reach dev` on 0.0.0.0:7070 and :7071,
# data in /var/lib/reach, a volume here and on Kubernetes), its ports published on free
# loopback ports, so that two runs never collide.
pod run -d --name "$name" "${run_opts[@]}" --volume "$data:/var/lib/reach" \
    --publish "127.0.0.1:$grpc_port:7070" --publish "127.0.0.1:$admin_port:7071" \
    "$image" >/dev/null || fail "podman run $image"

endpoint="127.0.0.1:$grpc_port"
serving=false
for _ in $(seq 1 100); do
    if out="$("$grpcurl" -plaintext -max-time 2 "$endpoint" grpc.health.v1.Health/Check 2>/dev/null)" &&
        [[ "$out" == *SERVING* ]]; then
        serving=true
        break
    fi
    sleep 0.2
done
$serving || fail "grpc.health.v1 on $endpoint never answered SERVING"
for service in "" reach.v1.RegistryService reach.v1.RouterService reach.v1.OrchestratorService; do
    out="$("$grpcurl" -plaintext -max-time 5 -d "{\"service\": \"$service\"}" "$endpoint" \
        grpc.health.v1.Health/Check)" || fail "health of \"$service\""
    [[ "$out" == *'"SERVING"'* ]] || fail "health of \"$service\": $out"
done
echo "   grpc.health.v1: SERVING (\"\", registry, router, orchestrator)"

health="$(curl -fsS --max-time 5 "http://127.0.0.1:$admin_port/health")" || fail "admin /health"
[[ "$health" == *'"ok"'* ]] || fail "admin /health: $health"
# Every service said SERVING above, so /ready (the same health as one answer) is 200.
ready="$(curl -fsS --max-time 5 "http://127.0.0.1:$admin_port/ready")" || fail "admin /ready"
[[ "$ready" == *'"serving"'* ]] || fail "admin /ready: $ready"
curl -fsS --max-time 5 "http://127.0.0.1:$admin_port/metrics" | grep -q '^reach_' ||
    fail "admin /metrics has no reach_ series"
echo "   admin: /health $health, /ready $ready, /metrics"

# The example agents register (ready once the registry's probe passes), and a call is routed.
routed=false
for _ in $(seq 1 50); do
    if out="$("$grpcurl" -plaintext -max-time 5 -d '{"message": {"header": {"capability": "complaint.classify"},
        "payload": {"type": "complaint.submitted", "parts": [{"data": {"complaint_id": "1",
        "narrative": "Equifax shows a derogatory tradeline on my credit report"}}]}}}' \
        "$endpoint" reach.v1.RouterService/Call 2>&1)" && [[ "$out" == *credit_report* ]]; then
        routed=true
        break
    fi
    sleep 0.2
done
$routed || fail "RouterService/Call complaint.classify: $out"
instances="$("$grpcurl" -plaintext -max-time 5 "$endpoint" reach.v1.RegistryService/ListInstances |
    grep -c '"instanceId"')" || fail "ListInstances"
echo "   registry: $instances instances; complaint.classify routed (credit_report)"

# SIGTERM: the agents drain, the control plane shuts down, the process exits 0.
stop_start=$(date +%s.%N)
pod stop --time 40 "$name" >/dev/null || fail "podman stop"
stopped_in=$(python3 -c "import time; print(f'{time.time() - $stop_start:.1f}')")
code="$(pod inspect --format '{{.State.ExitCode}}' "$name")"
[[ "$code" == 0 ]] || fail "reach dev exited $code after SIGTERM"
echo "   SIGTERM: exited 0 after ${stopped_in}s"
done_step checks

size="$(pod image inspect --format '{{.Size}}' "$image" | numfmt --to=iec)"
echo "== image: $image, ${size}B"
total=$(($(date +%s) - start_all))
for line in "${timings[@]}"; do
    echo "   $line"
done
echo "   total                              ${total}s"
