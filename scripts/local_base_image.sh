#!/usr/bin/env bash
# A Python 3.11 base image built from Debian packages, for a machine that cannot pull
# python:3.11-slim (no registry access) but reaches a Debian mirror: debootstrap a minimal
# bookworm, add a virtual environment with pip at /opt/python (first on PATH, so the
# Dockerfile's `pip install` works as on the official image) and the host's CA bundle (so pip
# trusts the same proxies the host does), and `podman import` it. Needs root, debootstrap and
# podman.
#   scripts/local_base_image.sh [TAG]     # default localhost/microserving-base:bookworm
set -euo pipefail
tag="${1:-localhost/microserving-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
rootfs="$(mktemp -d)"
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror"
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
chroot "$rootfs" python3 -m venv /opt/python
chroot "$rootfs" sh -c 'ln -sf /opt/python/bin/python /usr/local/bin/python'
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | podman import \
  --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' - "$tag"
podman images "$tag"
