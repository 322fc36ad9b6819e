#!/bin/sh
# The README's test command: installs the system packages the tests need
# (scripts/test-deps.sh; apt-get, as root), then runs every test of the
# workspace. CI runs exactly this.
set -eu
cd "$(dirname "$0")/.."
if [ "$(id -u)" -eq 0 ]; then
    sh scripts/test-deps.sh
elif command -v sudo >/dev/null 2>&1; then
    sudo sh scripts/test-deps.sh
else
    sh scripts/test-deps.sh
fi
# The end-to-end tests ship the slim agent that is built beside `provision`
# (target/debug/provision-agent); `cargo test` builds only the binaries of
# the package under test, so every binary of the workspace is built first.
cargo build --workspace --bins
# --no-fail-fast: every test binary runs even when one fails, and cargo ends
# with the list of the targets that failed (still exiting non-zero).
exec cargo test --workspace --no-fail-fast
