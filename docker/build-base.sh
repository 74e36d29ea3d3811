#!/usr/bin/env bash
# Builds the base images of colibri's containers from Debian packages, for machines that cannot
# pull from a container registry (CI here): debootstrap writes a minimal Debian root filesystem
# and `docker import` turns it into an image.
#
#   colibri-base:bookworm          Debian minbase + ca-certificates, curl (what `coli` needs at run
#                                  time: libc6, libgcc-s1 — see `ldd coli` — and curl for the
#                                  health check)
#   colibri-base-vulkan:bookworm   the same + Mesa's Vulkan drivers (lavapipe, a Vulkan device on
#                                  the CPU), the Vulkan loader and vulkan-tools (vulkaninfo)
#   colibri-nginx:bookworm         the same base + Debian's nginx-light: the load balancer in front
#                                  of several `coli` containers (docker/replicas.sh); built only
#                                  when asked for (ONLY=nginx or ONLY=all+nginx)
#
# An image that already exists is kept (FORCE=1 rebuilds). The Dockerfiles take them with
# --build-arg BASE=colibri-base:bookworm (Dockerfile, Dockerfile.cuda's CUDA_BASE for a check) or
# BASE=colibri-base-vulkan:bookworm (Dockerfile.vulkan). With a registry, use the default bases
# (debian:bookworm-slim) and skip this script.
#
# Needs root (debootstrap, chroot) and a Debian mirror: the one this machine's apt uses, else
# deb.debian.org (DEBIAN_MIRROR=URL overrides). Takes 1-3 minutes on 2 cores, once.
#
#   bash docker/build-base.sh            # colibri-base and colibri-base-vulkan, if missing
#   ONLY=cpu bash docker/build-base.sh   # only colibri-base (ONLY=vulkan: only the Vulkan one)
#   ONLY=nginx bash docker/build-base.sh # only colibri-nginx (ONLY=cpu+nginx: both)
set -euo pipefail

SUITE=${SUITE:-bookworm}
BASE_IMAGE=${BASE_IMAGE:-colibri-base:$SUITE}
VULKAN_IMAGE=${VULKAN_IMAGE:-colibri-base-vulkan:$SUITE}
NGINX_IMAGE=${NGINX_IMAGE:-colibri-nginx:$SUITE}
ONLY=${ONLY:-all}
FORCE=${FORCE:-0}

say() { printf 'build-base: %s\n' "$*"; }
die() { printf 'build-base: error: %s\n' "$*" >&2; exit 1; }
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

want_cpu=0 want_vulkan=0 want_nginx=0
IFS=+ read -r -a wanted <<<"$ONLY"
for w in "${wanted[@]}"; do
  case "$w" in
    all) want_cpu=1 want_vulkan=1 ;;
    cpu) want_cpu=1 ;;
    vulkan) want_vulkan=1 ;;
    nginx) want_nginx=1 ;;
    *) die "ONLY must be all, cpu, vulkan or nginx, or several joined with + (got '$ONLY')" ;;
  esac
done
if [ "$FORCE" != 1 ]; then
  if [ "$want_cpu" = 1 ] && have_image "$BASE_IMAGE"; then
    say "$BASE_IMAGE exists (cached; FORCE=1 rebuilds)"
    want_cpu=0
  fi
  if [ "$want_vulkan" = 1 ] && have_image "$VULKAN_IMAGE"; then
    say "$VULKAN_IMAGE exists (cached; FORCE=1 rebuilds)"
    want_vulkan=0
  fi
  if [ "$want_nginx" = 1 ] && have_image "$NGINX_IMAGE"; then
    say "$NGINX_IMAGE exists (cached; FORCE=1 rebuilds)"
    want_nginx=0
  fi
fi
[ "$want_cpu" = 1 ] || [ "$want_vulkan" = 1 ] || [ "$want_nginx" = 1 ] || exit 0

[ "$(id -u)" = 0 ] || die "debootstrap and chroot need root; run this script as root"
if ! command -v debootstrap >/dev/null 2>&1; then
  say "installing debootstrap (apt-get)"
  apt-get install -y -q debootstrap >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; } ||
    die "cannot install debootstrap"
fi

# The mirror this machine's apt uses for Debian itself (not -security, not third-party repos).
mirror_of_this_machine() {
  local files=() f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && files+=("$f")
  done
  [ "${#files[@]}" -gt 0 ] || return 0
  # One-line format (`deb [opts] URI suite ...`) and deb822 (`URIs: URI ...`).
  grep -hE '^[[:space:]]*(deb[[:space:]]|URIs:)' "${files[@]}" |
    sed -E 's/^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//; s/^[[:space:]]*URIs:[[:space:]]*//' |
    tr ' ' '\n' | grep -E '^https?://[^ ]*/debian/?$' | head -n 1 | sed 's:/$::'
}
MIRROR=${DEBIAN_MIRROR:-$(mirror_of_this_machine)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-${MIRROR}-security}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/colibri-base.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOTFS=$WORK/rootfs

in_root() {
  chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    DEBIAN_FRONTEND=noninteractive LC_ALL=C "$@"
}

start=$SECONDS
say "debootstrap --variant=minbase $SUITE from $MIRROR (the slow part: ~1-2 min)"
debootstrap --variant=minbase --include=ca-certificates,curl "$SUITE" "$ROOTFS" "$MIRROR" \
  >"$WORK/debootstrap.log" 2>&1 || { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }

# What debian:bookworm-slim does: no docs, man pages or translations from later installs, no
# recommends, no package cache kept.
mkdir -p "$ROOTFS/etc/dpkg/dpkg.cfg.d" "$ROOTFS/etc/apt/apt.conf.d"
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/colibri-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
cat >"$ROOTFS/etc/apt/apt.conf.d/colibri-slim" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb || true"; };
EOF
cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
say "apt-get upgrade (point release and security updates)"
if ! in_root apt-get update -q >"$WORK/apt.log" 2>&1; then
  say "warning: $MIRROR $SUITE-updates or $SECURITY_MIRROR unreachable; the base keeps the release's packages"
  echo "deb $MIRROR $SUITE main" >"$ROOTFS/etc/apt/sources.list"
  in_root apt-get update -q >>"$WORK/apt.log" 2>&1 || { tail -n 20 "$WORK/apt.log" >&2; die "apt-get update failed"; }
fi
in_root apt-get -y -q upgrade >>"$WORK/apt.log" 2>&1 || { tail -n 20 "$WORK/apt.log" >&2; die "apt-get upgrade failed"; }

# Remove what a runtime image does not need; apt's lists are left out of the image by `tar`.
slim() {
  in_root apt-get clean
  find "$ROOTFS/usr/share/doc" -mindepth 1 ! -name copyright ! -type d -delete
  find "$ROOTFS/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/var/cache/debconf/*-old
  find "$ROOTFS/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  find "$ROOTFS/var/log" -type f -exec truncate -s 0 {} +
}

# `docker import` of the root filesystem, with the PATH and command an image from a Dockerfile has
# (further `--change` instructions may follow the description).
import() {
  local tag=$1 description=$2
  shift 2
  local changes=(--change 'CMD ["bash"]')
  [ "$#" = 0 ] || changes=("$@")
  tar -C "$ROOTFS" --numeric-owner \
    --exclude=./var/lib/apt/lists/* --exclude=./var/cache/apt/*.bin \
    --exclude=./etc/resolv.conf --exclude=./etc/hostname --exclude=./etc/hosts \
    -c . |
    docker import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      "${changes[@]}" \
      --change "LABEL org.opencontainers.image.description=\"$description\"" \
      --change "LABEL org.colibri.debian-mirror=\"$MIRROR\"" \
      --message "colibri: docker/build-base.sh ($SUITE from $MIRROR)" \
      - "$tag" >/dev/null
  say "imported $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
}

slim
if [ "$want_cpu" = 1 ]; then
  import "$BASE_IMAGE" "Debian $SUITE minbase with ca-certificates and curl (colibri's runtime base)"
fi
if [ "$want_nginx" = 1 ]; then
  # On a copy of the root filesystem, so that the Vulkan image below does not get nginx.
  base_rootfs=$ROOTFS
  ROOTFS=$WORK/rootfs-nginx
  cp -a "$base_rootfs" "$ROOTFS"
  say "installing nginx-light"
  # No service is started inside the chroot (invoke-rc.d asks policy-rc.d).
  printf '#!/bin/sh\nexit 101\n' >"$ROOTFS/usr/sbin/policy-rc.d"
  chmod 0755 "$ROOTFS/usr/sbin/policy-rc.d"
  in_root apt-get install -y -q nginx-light >>"$WORK/apt.log" 2>&1 ||
    { tail -n 20 "$WORK/apt.log" >&2; die "installing nginx-light failed"; }
  rm -f "$ROOTFS/usr/sbin/policy-rc.d"
  slim
  # The configuration comes with `-c FILE` (docker/replicas.sh mounts one); -e stderr: the
  # compiled-in error log under /var/log/nginx is not writable for a non-root user. nginx's
  # graceful stop is SIGQUIT (requests in progress finish): `docker run --stop-signal SIGQUIT`
  # (`docker import` cannot set STOPSIGNAL).
  import "$NGINX_IMAGE" "colibri-base + Debian's nginx-light (the load balancer of docker/replicas.sh)" \
    --change 'ENTRYPOINT ["nginx", "-e", "stderr", "-g", "daemon off;"]' \
    --change 'CMD ["-c", "/etc/nginx/nginx.conf"]' \
    --change 'EXPOSE 8080'
  rm -rf "$ROOTFS"
  ROOTFS=$base_rootfs
fi
if [ "$want_vulkan" = 1 ]; then
  # python3-minimal satisfies mesa-vulkan-drivers' `python3 | python3-minimal` without the full
  # Python (apt would pick python3, the first alternative, and ~40 MB more).
  say "installing mesa-vulkan-drivers libvulkan1 vulkan-tools"
  in_root apt-get install -y -q python3-minimal mesa-vulkan-drivers libvulkan1 vulkan-tools \
    >>"$WORK/apt.log" 2>&1 || { tail -n 20 "$WORK/apt.log" >&2; die "installing the Vulkan packages failed"; }
  slim
  import "$VULKAN_IMAGE" "colibri-base + Mesa's Vulkan drivers (lavapipe), the Vulkan loader and vulkan-tools"
fi
say "done in $((SECONDS - start)) s"
