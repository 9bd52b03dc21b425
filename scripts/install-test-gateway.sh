#!/usr/bin/env bash
# Installs the real clients tests/gateway_*.rs drive through the gateway
# (never a hosted API: every test points them at loopback servers):
#   - the official `openai` and `anthropic` Python SDKs (and `zstandard`,
#     to send zstd request bodies as Codex does, and `httpx` for the raw
#     requests Codex makes that the SDK does not) into ./.venv-gateway;
#   - the Codex CLI (`@openai/codex`) and Claude Code
#     (`@anthropic-ai/claude-code`) from npm into ./.npm-gateway.
# Versions are pinned so a release cannot change what the tests see.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-gateway"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "openai==3.57.0" "anthropic==2.16.0" "zstandard==0.25.0" "httpx==0.28.1"
"$venv/bin/python" -c 'import openai, anthropic, zstandard, httpx'

if command -v npm >/dev/null 2>&1; then
    mkdir -p "$root/.npm-gateway"
    cd "$root/.npm-gateway"
    [ -f package.json ] || echo '{"name":"contextfold-gateway-clients","private":true}' > package.json
    if [ ! -x node_modules/.bin/codex ] || [ ! -x node_modules/.bin/claude ]; then
        npm install --no-audit --no-fund --silent \
            "@openai/codex@0.171.0" "@anthropic-ai/claude-code@2.1.332"
    fi
    node_modules/.bin/codex --version >/dev/null
else
    echo "install-test-gateway: npm not found; the Codex CLI test will skip" >&2
fi
echo "install-test-gateway: SDKs in $venv, CLIs in $root/.npm-gateway"
