#!/bin/bash
# auth_guest.sh -- the guest for the DH-HMAC-CHAP test (tests/interop/test_nvme_auth_guest.py): the shared
# ../shared/peers/linux-guest/run-guest-test.sh, booted with a Debian kernel that has NVMe in-band
# authentication. Debian 12's own 6.1 kernel has `# CONFIG_NVME_AUTH is not set`; bookworm-backports' kernel
# (6.12) has CONFIG_NVME_HOST_AUTH=y with nvme-auth as a module.
#
# Usage (root):
#   tests/interop/auth_guest.sh          prepare and build the guest (idempotent, cached); prints its VMDIR
#   tests/interop/auth_guest.sh run      run-guest-test.sh run in that VMDIR (same env knobs as the script)
#
# The guest script builds a kernel only when $BUILD/kernel/.done and $BUILD/vmlinux are missing, so this fills
# them from the backports package first; the debootstrap root is reused from the standard guest's cache
# (hard links, so neither copy can disturb the other) when that one is built. What is cached where:
#   AUTH_VMDIR [${XDG_CACHE_HOME:-$HOME/.cache}/openvsan-guest-auth]  this guest (kernel, initramfs: ~350 MB)
#   VMDIR      [${XDG_CACHE_HOME:-$HOME/.cache}/openvsan-guest]       the standard guest, whose rootfs is reused
# Needs: apt with a bookworm-backports source (.ci/run adds it), dpkg-deb, python3, zstd (the 6.12 bzImage is
# zstd-compressed), and what run-guest-test.sh needs.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
GUEST=${GUEST:-$(cd "$HERE/../../.." && pwd)/shared/peers/linux-guest/run-guest-test.sh}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}
AUTH_VMDIR=${AUTH_VMDIR:-$CACHE/openvsan-guest-auth}
MAIN_BUILD=${VMDIR:-$CACHE/openvsan-guest}/build
BUILD=$AUTH_VMDIR/build
# Run-time needs of the kernel host's DH-HMAC-CHAP: nvme-auth (also a dependency of nvme-core), and the
# crypto it asks for on demand (crypto_alloc_shash("hmac(sha256)"), crypto_alloc_kpp("ffdhe2048(dh)")),
# which no module dependency brings along: those that are modules rather than built in go into the initramfs.
AUTH_MODULES="nvme_auth nvme_keyring hmac sha256_generic sha512_generic dh_generic kpp"

log() { printf '[auth-guest %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (the guest build uses chroot and debootstrap)"
[ -f "$GUEST" ] || die "$GUEST is missing: clone the repo with ../shared beside it"

guest_modules() {   # those of AUTH_MODULES that the kernel has as loadable modules
    local kdir=$BUILD/kernel/lib/modules/$1 m out=""
    for m in $AUTH_MODULES; do
        grep -qE "/${m//_/[-_]}\.ko$" "$kdir/modules.builtin" && continue
        find "$kdir/kernel" -regextype egrep -regex ".*/${m//_/[-_]}\.ko(\.xz|\.zst|\.gz)?" | grep -q . \
            || die "kernel $1 has no $m, built in or as a module"
        out="$out $m"
    done
    echo "${out# }"
}

kernel_package() {  # the backports kernel that linux-image-amd64 points to
    apt-cache depends -t bookworm-backports linux-image-amd64 2>/dev/null \
        | awk '/Depends: linux-image-[0-9]/{print $2; exit}'
}

prepare_kernel() {
    [ -f "$BUILD/kernel/.done" ] && [ -f "$BUILD/vmlinux" ] && return 0
    command -v zstd >/dev/null || die "zstd is missing: apt-get install zstd (or run \`sudo bash .ci/run\`)"
    local pkg
    pkg=$(kernel_package)
    [ -n "$pkg" ] || { apt-get update -qq; pkg=$(kernel_package); }
    [ -n "$pkg" ] || die "no bookworm-backports kernel: add the bookworm-backports apt source (as .ci/run does)"
    log "apt-get download -t bookworm-backports $pkg"
    rm -rf "$BUILD/kernel" "$BUILD/vmlinux" "$BUILD/debs"
    mkdir -p "$BUILD/debs" "$BUILD/kernel"
    (cd "$BUILD/debs" && apt-get download -t bookworm-backports "$pkg" >/dev/null 2>&1) \
        || die "apt-get download -t bookworm-backports $pkg failed"
    dpkg-deb -x "$BUILD"/debs/"$pkg"_*.deb "$BUILD/kernel"
    rm -rf "$BUILD/debs"
    local config
    config=$(ls "$BUILD"/kernel/boot/config-*)
    grep -q '^CONFIG_NVME_HOST_AUTH=y' "$config" || die "$pkg has no CONFIG_NVME_HOST_AUTH ($config)"
    # The ELF vmlinux out of the bzImage, so QEMU boots its PVH entry (as run-guest-test.sh does for 6.1's XZ
    # one). Boot protocol (Documentation/arch/x86/boot.rst): setup_sects at 0x1f1, payload_offset/_length at
    # 0x248/0x24c from the protected-mode code; the payload ends with the uncompressed size (le32).
    python3 - "$BUILD"/kernel/boot/vmlinuz-* "$BUILD/vmlinux.tmp" <<'EOF'
import lzma, struct, subprocess, sys, zlib
img = open(sys.argv[1], "rb").read()
assert img[0x202:0x206] == b"HdrS", "not a bzImage"
setup_sects = img[0x1F1] or 4
offset, length = struct.unpack_from("<II", img, 0x248)
start = (setup_sects + 1) * 512 + offset
payload, size = img[start:start + length - 4], struct.unpack_from("<I", img, start + length - 4)[0]
if payload.startswith(b"\x28\xb5\x2f\xfd"):
    elf = subprocess.run(["zstd", "-dcq"], input=payload, stdout=subprocess.PIPE, check=True).stdout
elif payload.startswith(b"\xfd7zXZ\x00"):
    elf = lzma.LZMADecompressor().decompress(payload)
elif payload.startswith(b"\x1f\x8b"):
    elf = zlib.decompress(payload, 16 + zlib.MAX_WBITS)
else:
    raise SystemExit(f"unknown bzImage compression {payload[:4].hex()}")
assert elf[:4] == b"\x7fELF" and len(elf) == size, "the payload is not the ELF vmlinux it says"
open(sys.argv[2], "wb").write(elf)
EOF
    mv "$BUILD/vmlinux.tmp" "$BUILD/vmlinux"
    touch "$BUILD/kernel/.done"
    log "kernel $(ls "$BUILD/kernel/lib/modules") ready"
}

prepare_rootfs() {
    [ -f "$BUILD/rootfs/.done" ] && return 0
    [ -f "$MAIN_BUILD/rootfs/.done" ] || { log "no standard guest rootfs in $MAIN_BUILD: the guest script debootstraps one"; return 0; }
    log "rootfs: hard links to $MAIN_BUILD/rootfs"
    rm -rf "$BUILD/rootfs" "$BUILD/rootfs.tmp"
    # Hard links: nothing writes into a rootfs file in place (a rebuild removes the tree and debootstraps
    # anew; the initramfs build only adds its own kroot/), so the two caches stay independent.
    cp -al "$MAIN_BUILD/rootfs" "$BUILD/rootfs.tmp" 2>/dev/null \
        || { rm -rf "$BUILD/rootfs.tmp"; cp -a --reflink=auto "$MAIN_BUILD/rootfs" "$BUILD/rootfs.tmp"; }
    rm -rf "$BUILD/rootfs.tmp/kroot"
    mv "$BUILD/rootfs.tmp" "$BUILD/rootfs"
}

mkdir -p "$BUILD"
exec 9> "$AUTH_VMDIR/.lock"
flock 9                        # .ci/run and the test may both prepare it
prepare_kernel
prepare_rootfs
KVER=$(ls "$BUILD/kernel/lib/modules")
export VMDIR=$AUTH_VMDIR BUILD GUEST_MODULES
GUEST_MODULES=$(guest_modules "$KVER")
case "${1:-build}" in
    build)
        bash "$GUEST" build >&2
        echo "$AUTH_VMDIR"
        ;;
    run)
        flock -u 9
        exec bash "$GUEST" run
        ;;
    *) echo "usage: $0 [build|run]" >&2; exit 2 ;;
esac
