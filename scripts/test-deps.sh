#!/bin/sh
# Installs the system packages the test suites need (Debian, as root).
# Idempotent and quiet: packages already present are not touched.
#
#   provisioning-ssh tests: openssh-server (/usr/sbin/sshd), openssh-client
#   (ssh, ssh-keygen), util-linux (flock, setsid on the test hosts) and
#   iproute2 (network namespaces for the testbed).
#   provisioning-ec2 tests: python3 and python3-venv for a virtual
#   environment holding the Python packages below (moto, the EC2 API server
#   the EC2 testbed wraps).
#   provisioning-slurm tests: slurmctld, slurmd and slurm-client (Slurm's
#   daemons and commands) and munge (its authentication daemon).
set -eu

packages="openssh-server openssh-client util-linux iproute2 slurmctld slurmd slurm-client munge tmux python3 python3-venv"

# The Python packages of the test virtual environment, one pip requirement
# each (space-separated): kept in one variable so that adding one is one edit.
python_packages="moto[server]"
venv="${PROVISION_TEST_VENV:-/opt/provisioning-test/venv}"

# Creates the virtual environment and installs what it lacks (idempotent).
install_python_packages() {
    if [ ! -x "$venv/bin/python" ]; then
        /usr/bin/python3 -m venv "$venv"
    fi
    # shellcheck disable=SC2086
    if ! "$venv/bin/python" -m pip show -q $(echo "$python_packages" | sed 's/\[[^]]*\]//g') >/dev/null 2>&1; then
        # shellcheck disable=SC2086
        "$venv/bin/python" -m pip install -q --disable-pip-version-check $python_packages
        echo "test-deps.sh: installed into $venv: $python_packages"
    fi
}

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
