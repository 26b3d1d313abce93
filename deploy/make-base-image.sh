#!/usr/bin/env bash
# Builds a slim Debian bookworm image with Python 3.11 and a C compiler, from Debian's own
# packages, for hosts that cannot pull from a container registry. pdserve's images build on it:
#
#   sudo deploy/make-base-image.sh                 # -> image pdserve-base:bookworm
#   docker-compose -f deploy/docker-compose.yml build --build-arg BASE_IMAGE=pdserve-base:bookworm
#
# Needs root, debootstrap and a Debian mirror (DEBIAN_MIRROR, default deb.debian.org).
set -euo pipefail

tag="${1:-pdserve-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT

debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,gcc,libc6-dev,ca-certificates \
    bookworm "$root" "$mirror"
# The image's own apt sources, and no caches or logs from the build.
echo "deb $mirror bookworm main" > "$root/etc/apt/sources.list"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log

tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$tag"
echo "built $tag"
