#!/usr/bin/env bash
# Installs ROCm's device libraries (ocml, ockl and their oclc_* controls: LLVM bitcode that an
# AMD GPU kernel calling a math function links at compile time) from Debian's
# rocm-device-libs package, pinned by version and hash below, into a cache directory, so that
# the AMD kernels' offline test (tests/cubecl/cube_kernels.rs: kiln's CubeCL kernels compiled
# for gfx942 and gfx90a and linked into code objects) runs with no GPU and no ROCm.
#
# Only the package's file is fetched (`apt-get download`, no install, nothing under /usr) and
# unpacked with dpkg-deb. Debian 12's package is ROCm 5.2's bitcode, which LLVM 23 reads (it
# upgrades older bitcode); it predates gfx942 (MI300X), so it has no oclc_isa_version_942.bc
# and the test links gfx942's math kernels against gfx940's (see the test).
#
# Usage: scripts/install-rocm-device-libs.sh                install (a no-op when done)
#        scripts/install-rocm-device-libs.sh --print-dir    the directory holding ocml.bc
# Environment:
#   KILN_ROCM_DEVICE_LIBS_DIR  where the package is unpacked (default
#                              ${XDG_CACHE_HOME:-~/.cache}/kiln/rocm-device-libs-5.2.3-2, 3 MB)
#   KILN_ROCM_DEVICE_LIBS_DEB  the package's .deb, already fetched (air-gapped hosts)
# The test finds the directory the same way (KILN_ROCM_DEVICE_LIBS_DIR, else that default).
set -euo pipefail

version=5.2.3-2
sha256=c3fba847565141ac15b72164cbb3513bb919b1b5c15244112489d36fd5a75a79 # amd64, Debian 12
die() {
  echo "install-rocm-device-libs: error: $*" >&2
  exit 1
}
[ -n "${HOME:-}" ] || die "HOME is not set"
root=${KILN_ROCM_DEVICE_LIBS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/rocm-device-libs-$version}
dir=$root/usr/lib/x86_64-linux-gnu/amdgcn/bitcode
stamp=$root/.kiln-rocm-device-libs-installed

case "${1:-}" in
  "") ;;
  --print-dir)
    echo "$dir"
    exit 0
    ;;
  *) die "unknown argument '$1' (use --print-dir)" ;;
esac

ok() { [ -f "$dir/ocml.bc" ] && [ -f "$dir/ockl.bc" ] && [ -f "$dir/oclc_isa_version_90a.bc" ]; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sha256" ] && ok; then
  echo "install-rocm-device-libs: ready at $dir"
  exit 0
fi

mkdir -p "$(dirname "$root")"
tmp=$(mktemp -d "$root.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
deb=${KILN_ROCM_DEVICE_LIBS_DEB:-}
if [ -z "$deb" ]; then
  command -v apt-get >/dev/null || die "no apt-get here: fetch rocm-device-libs_${version}_amd64.deb
  elsewhere and set KILN_ROCM_DEVICE_LIBS_DEB to it"
  echo "install-rocm-device-libs: fetching Debian's rocm-device-libs $version"
  # apt-get download writes to the current directory; as root it warns that the _apt user
  # cannot write there, and fetches anyway.
  if ! (cd "$tmp" && apt-get download -qq "rocm-device-libs:amd64=$version" 2>/dev/null); then
    apt-get update -qq || true
    (cd "$tmp" && apt-get download -qq "rocm-device-libs:amd64=$version") ||
      die "apt-get could not fetch rocm-device-libs $version (Debian 12's; another release's
  apt sources have another version: fetch rocm-device-libs_${version}_amd64.deb from Debian 12
  and set KILN_ROCM_DEVICE_LIBS_DEB to it)"
  fi
  deb=$(echo "$tmp"/rocm-device-libs_*.deb)
fi
[ -f "$deb" ] || die "no such package file: $deb"
got=$(sha256sum "$deb" | cut -d' ' -f1)
[ "$got" = "$sha256" ] || die "$deb has SHA-256 $got, not the pinned $sha256"
dpkg-deb -x "$deb" "$tmp/unpacked"
rm -rf "$root"
mv "$tmp/unpacked" "$root"
rm -rf "$tmp"
trap - EXIT
ok || die "the package did not give ocml.bc, ockl.bc and oclc_isa_version_90a.bc in $dir"
echo "$sha256" >"$stamp"
echo "install-rocm-device-libs: ready at $dir"
