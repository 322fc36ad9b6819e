#!/bin/sh
# Installs the system packages the test suites need (Debian, as root).
# Idempotent and quiet: packages already present are not touched.
#
#   provisioning-ssh tests: openssh-server (/usr/sbin/sshd), openssh-client
#   (ssh, ssh-keygen), util-linux (flock, setsid on the test hosts) and
#   iproute2 (network namespaces for the testbed).
#   provisioning-slurm tests: slurmctld, slurmd and slurm-client (Slurm's
#   daemons and commands) and munge (its authentication daemon).
#
# Then the Python packages the end-to-end tests use, in a virtual
# environment at ${PROVISION_TEST_VENV:-/opt/provisioning-test/venv}
# (made with python3 -m venv when absent):
#
#   provision-cli e2e_dask: dask[distributed] (a real distributed engine
#   across a local fleet, examples/dask.toml).
set -eu

venv="${PROVISION_TEST_VENV:-/opt/provisioning-test/venv}"
python_packages="dask[distributed]"

install_python_packages() {
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
    fi
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q --disable-pip-version-check $python_packages
}

packages="openssh-server openssh-client util-linux iproute2 slurmctld slurmd slurm-client munge tmux"

missing=""
for package in $packages; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $package"
    fi
done

if [ -z "$missing" ]; then
    install_python_packages
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
# The packages may start a system sshd, munged or Slurm daemons; the tests
# run their own (with their own configuration) and need none of them.
echo "test-deps.sh: installed$missing"
install_python_packages
