#!/bin/sh
# Installs the system packages the test suites need (Debian, as root).
# Idempotent and quiet: packages already present are not touched.
#
#   provisioning-ssh tests: openssh-server (/usr/sbin/sshd), openssh-client
#   (ssh, ssh-keygen), util-linux (flock, setsid on the test hosts) and
#   iproute2 (network namespaces for the testbed).
#   provisioning-slurm tests: slurmctld, slurmd and slurm-client (Slurm's
#   daemons and commands) and munge (its authentication daemon).
#   provisioning-container tests: docker.io (dockerd, containerd and the
#   docker client; the tests start their own daemon on a socket of their
#   own), podman, and runc (Podman's default crun refuses this machine's
#   hybrid cgroups; runc works).
set -eu

packages="openssh-server openssh-client util-linux iproute2 slurmctld slurmd slurm-client munge tmux docker.io podman runc"

missing=""
for package in $packages; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $package"
    fi
done

if [ -z "$missing" ]; then
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "test-deps.sh: missing packages:$missing; run this script as root" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing >/dev/null
# The packages may start a system sshd, munged, Slurm or Docker daemons; the
# tests run their own (with their own configuration) and need none of them.
echo "test-deps.sh: installed$missing"
