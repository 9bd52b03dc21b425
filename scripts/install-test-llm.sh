#!/usr/bin/env bash
# Installs the OpenAI-compatible mock servers that tests/summarizer_llm.rs
# runs on loopback (never a hosted API):
#   - llmock  : resilience faults (429 + Retry-After, 4xx/5xx, latency), and a
#               journal of every request it served, to count calls;
#   - fakellm : rule-scripted answers (matched on model and prompt text), to
#               serve chain-of-thought, oversized, empty, continuation and
#               identifier-dropping "summaries".
# Into a virtualenv: $CONTEXTFOLD_VENV if set, else ./.venv-llm.
# Versions are pinned (and the web stack under them, via constraints) so a
# new release cannot change what the tests see.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CONTEXTFOLD_VENV:-$root/.venv-llm}"
python="${PYTHON:-python3}"

if ! command -v "$python" >/dev/null 2>&1; then
    echo "install-test-llm: $python not found; install Python 3.10+ (apt-get install python3 python3-venv)" >&2
    exit 1
fi

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
cat >"$constraints" <<'PINS'
fastapi==0.165.0
starlette==1.10.0
pydantic==2.14.4
pydantic_core==2.50.5
uvicorn==0.54.0
httpx==0.28.1
PyYAML==6.0.4
click==8.5.1
typer==0.29.2
PINS

"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -c "$constraints" "llmock==0.2.2" "fakellm==0.3.5"

"$venv/bin/llmock" --help >/dev/null
"$venv/bin/fakellm" --help >/dev/null
echo "install-test-llm: llmock and fakellm ready in $venv"
