#!/usr/bin/env bash
# Is there room for a full `invoke test`? Checked before half an hour of tests, not found after
# it: a full disk fails a hundred tests at once with errors that name the symptom, never the disk.
#
#   VLLMSTACK_MIN_FREE_GIB=N bash scripts/disk-check.sh PATH...
#
# Each PATH is where the suite writes (the checkout, TMPDIR, Docker's and Podman's storage, HOME);
# one that does not exist yet is measured at its nearest existing parent. Paths on one device (a
# bind mount, as dockerd's root often is) are one disk, counted once. Exit 1 when a disk has less
# than N GiB free, naming its paths and what Docker reports as reclaimable. N=0: no check.
set -euo pipefail

MIN_FREE_GIB=${VLLMSTACK_MIN_FREE_GIB:-12}
DOCKER=${DOCKER:-docker}
[[ "$MIN_FREE_GIB" =~ ^[0-9]+$ ]] || {
    echo "disk-check: VLLMSTACK_MIN_FREE_GIB=$MIN_FREE_GIB is not a whole number of GiB" >&2; exit 2; }

declare -A held=() free_kib=()
order=()
for place in "$@"; do
    probe=$place
    until [ -e "$probe" ]; do probe=$(dirname "$probe"); done
    device=$(stat -c %d "$probe")
    [ -n "${held[$device]:-}" ] || order+=("$device")
    held[$device]="${held[$device]:+${held[$device]}, }$place"
    free_kib[$device]=$(df -P -k "$probe" | awk 'NR == 2 {print $4}')
done
short=0
for device in "${order[@]}"; do
    gib=$(( free_kib[$device] / 1048576 ))
    if [ "$gib" -ge "$MIN_FREE_GIB" ]; then
        echo "disk-check: $gib GiB free for ${held[$device]}"
    else
        echo "disk-check: only $gib GiB free for ${held[$device]}; a full run writes up to" \
             "$MIN_FREE_GIB GiB on one disk" >&2
        short=1
    fi
done
[ "$short" -eq 0 ] && exit 0
{
    echo "disk-check: what writes there: the engine installs under .cache/, images, and the"
    echo "  real-engine and README-walk tests (a passing test's tmp_path is removed at its end)"
    if reclaimable=$("$DOCKER" system df --format '{{.Type}}: {{.Reclaimable}}' 2>/dev/null); then
        echo "disk-check: Docker reports as reclaimable:"
        sed 's/^/  /' <<<"$reclaimable"
    fi
    echo "fix: free space (docker image prune; docker builder prune; podman image prune; old runs"
    echo "  in ${TMPDIR:-/tmp}/pytest-of-$(id -un)), or run anyway with VLLMSTACK_MIN_FREE_GIB=0"
} >&2
exit 1
