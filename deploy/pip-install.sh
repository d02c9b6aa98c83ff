#!/bin/sh
# `pip install "$@"` for deploy/Dockerfile (bind-mounted there, never copied
# into the image).
#
# - An empty PIP_INDEX_URL build argument means PyPI (pip would take '' as
#   the index itself).
# - The optional BuildKit secret `ca_bundle` (a PEM bundle: a corporate root
#   CA) is trusted beside pip's own roots for this command only: the combined
#   bundle is a temporary file, deleted before the layer is committed.
set -eu

if [ -z "${PIP_INDEX_URL:-}" ]; then
    unset PIP_INDEX_URL
fi

secret=/run/secrets/ca_bundle
if [ -s "$secret" ]; then
    bundle=$(mktemp)
    trap 'rm -f "$bundle"' EXIT
    cat "$(python -c 'from pip._vendor import certifi; print(certifi.where())')" "$secret" > "$bundle"
    export PIP_CERT="$bundle" SSL_CERT_FILE="$bundle" REQUESTS_CA_BUNDLE="$bundle"
fi

python -m pip install "$@"
