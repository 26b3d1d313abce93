#!/usr/bin/env bash
# The programs the tests run beside Python, installed where they are missing: promtool, which
# runs the alert rules' unit tests (deploy/alerts_test.yml), from Debian's prometheus package.
# Without apt-get this fails, naming what is missing, rather than let those tests skip.
set -euo pipefail

command -v promtool >/dev/null 2>&1 && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "promtool is not installed and there is no apt-get here to install it: install" \
        "Prometheus's promtool (it runs deploy/alerts_test.yml) and run make test again" >&2
    exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "promtool is not installed, and installing it (apt-get install prometheus) needs" \
            "root or sudo" >&2
        exit 1
    fi
    sudo="sudo"
fi
echo "installing promtool (Debian's prometheus package) for the alert rules' tests" >&2
$sudo apt-get update
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus
# Only the tool is wanted: where systemd started the package's server, stop it (it would hold
# port 9090, which docker-compose's Prometheus needs).
if [ -d /run/systemd/system ]; then
    $sudo systemctl disable --now prometheus.service \
        || echo "could not stop prometheus.service: it may hold port 9090" >&2
fi
if ! command -v promtool >/dev/null 2>&1; then
    echo "the prometheus package is installed but promtool is not on PATH" >&2
    exit 1
fi
