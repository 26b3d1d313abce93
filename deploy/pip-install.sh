#!/bin/sh
# `pip install` for the image build: from $WHEELS_URL alone when it is set (a folder of wheels
# served over HTTP, for hosts without PyPI: deploy/build-local.sh), from PyPI otherwise.
set -e
if [ -n "${WHEELS_URL:-}" ]; then
    host=${WHEELS_URL#*://}
    host=${host%%[:/]*}
    exec pip install --no-index --find-links "$WHEELS_URL" --trusted-host "$host" "$@"
fi
exec pip install "$@"
