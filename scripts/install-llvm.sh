#!/usr/bin/env bash
# Installs the LLVM 23.1 that kiln's LLVM-linked CubeCL backends build against, so that
# `cargo build --features kiln/cuda` (NVPTX) and `--features kiln/cpu` (CubeCL's CPU
# runtime) need no network.
#
# Why: burn's `cuda` and `cpu` backends depend on cubecl-llvm, whose build-dependency
# tracel-llvm-bundler downloads an LLVM 23.1 bundle from GitHub at build time unless
#   <XDG_DATA_HOME or ~/.local/share>/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed
# exists; then it only runs that prefix's `bin/llvm-config`. PyPI has the same LLVM as
# static libraries with headers and a Python `llvm-config` (mlc-llvm-static, plus the
# -extra-targets wheel for NVPTX and AMDGPU). This script installs those two wheels, with
# versions and hashes pinned in scripts/llvm-requirements.txt, and points the bundler's
# directory at them. Distribution LLVMs are no substitute: llvm-sys 231 hard-codes C-API
# enum values that LLVM 23 renumbered.
#
# Usage: scripts/install-llvm.sh            install (a no-op, in well under a second, when done)
#        scripts/install-llvm.sh --check    only report whether it is installed (exit 1 if not)
#        scripts/install-llvm.sh --print-prefix
# Environment:
#   KILN_LLVM_DIR     where the wheels are unpacked (default
#                     ${XDG_CACHE_HOME:-~/.cache}/kiln/mlc-llvm-static-23.1.1.post0, ~400 MB)
#   KILN_LLVM_WHEELS  a directory holding the two .whl files: install from it with no index
#                     (air-gapped hosts; fetch them elsewhere with `pip download --no-deps
#                     -r scripts/llvm-requirements.txt -d DIR`)
#   XDG_DATA_HOME     as the bundler reads it
# Needs: python3 >= 3.10 with pip (to install, and at build time: `llvm-config` is a Python
# script and python3 must be on PATH while cargo builds).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
req="$here/llvm-requirements.txt"
version=23.1.1.post0
bundle_name=tracel-llvm-23.1.0-4 # tracel-llvm-bundler 23.1.0-4, as Cargo.lock pins it

die() {
  echo "install-llvm: error: $*" >&2
  exit 1
}
[ -n "${HOME:-}" ] || die "HOME is not set"
cache_home=${XDG_CACHE_HOME:-$HOME/.cache}
data_home=${XDG_DATA_HOME:-$HOME/.local/share}
case "$data_home" in
  /*) ;;
  *) die "XDG_DATA_HOME must be an absolute path (the bundler ignores a relative one): $data_home" ;;
esac
root=${KILN_LLVM_DIR:-$cache_home/kiln/mlc-llvm-static-$version}
prefix=$root/mlc_llvm_static/static
bundle=$data_home/tracel/$bundle_name
sentinel=$bundle/.tracel-llvm-installed
stamp=$root/.kiln-llvm-installed

mode=install
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  --print-prefix)
    echo "$prefix"
    exit 0
    ;;
  -h | --help)
    sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *) die "unknown argument '$1' (use --check, --print-prefix or --help)" ;;
esac

command -v python3 >/dev/null || die "python3 is not on PATH; install python3 (>= 3.10) with pip"
req_sum=$(sha256sum "$req" | cut -d' ' -f1)

llvm_ok() { # $1: prefix; prints nothing, succeeds if its llvm-config is LLVM 23 with NVPTX
  local v t
  v=$("$1/bin/llvm-config" --version 2>/dev/null) || return 1
  t=$("$1/bin/llvm-config" --targets-built 2>/dev/null) || return 1
  [[ "$v" == 23.* && " $t " == *" NVPTX "* ]]
}

installed() {
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$req_sum" ] &&
    [ -L "$bundle" ] && [ "$(readlink "$bundle")" = "$prefix" ] && [ -e "$sentinel" ] &&
    llvm_ok "$prefix"
}

if installed; then
  echo "install-llvm: LLVM $("$prefix/bin/llvm-config" --version) ready at $prefix (bundler dir $bundle)"
  exit 0
fi
if [ "$mode" = check ]; then
  echo "install-llvm: not installed (run scripts/install-llvm.sh)" >&2
  exit 1
fi

mkdir -p "$(dirname "$root")" "$(dirname "$bundle")"
# One installer at a time (two CI jobs on one host share the cache).
if command -v flock >/dev/null; then
  exec 9>"$root.lock"
  flock 9
fi

# 1) The wheels, unpacked into $root (atomically: a temporary directory, renamed when done).
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$req_sum" ] && llvm_ok "$prefix"; then
  echo "install-llvm: wheels already unpacked at $root"
else
  python3 -m pip --version >/dev/null 2>&1 ||
    die "python3 has no pip (Debian: apt-get install python3-pip)"
  pip_args=(--disable-pip-version-check --no-input --no-deps --only-binary=:all:
    --require-hashes -r "$req")
  if [ -n "${KILN_LLVM_WHEELS:-}" ]; then
    [ -d "$KILN_LLVM_WHEELS" ] || die "KILN_LLVM_WHEELS=$KILN_LLVM_WHEELS is not a directory"
    pip_args+=(--no-index --find-links "$KILN_LLVM_WHEELS")
  fi
  tmp=$(mktemp -d "$root.tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "install-llvm: installing mlc-llvm-static $version (+ extra targets) from PyPI into $root"
  # --target installs into a plain directory: no virtual environment, and none of PEP 668's
  # refusal to touch a system Python.
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install "${pip_args[@]}" --target "$tmp" ||
    die "pip could not install the pinned LLVM wheels (network? a hash mismatch means the
  wheels on the index are not the ones pinned in $req)"
  llvm_ok "$tmp/mlc_llvm_static/static" ||
    die "the installed llvm-config is not LLVM 23 with NVPTX: $tmp/mlc_llvm_static/static/bin/llvm-config"
  rm -rf "$root"
  mv "$tmp" "$root"
  trap - EXIT
  echo "$req_sum" >"$stamp"
fi

# 2) The bundler's directory: a link to the prefix, with its sentinel.
if [ -L "$bundle" ]; then
  rm -f "$bundle"
elif [ -d "$bundle" ]; then
  if [ -e "$sentinel" ] && llvm_ok "$bundle"; then
    echo "install-llvm: $bundle holds the bundler's own download; replacing it with a link to $prefix"
  else
    echo "install-llvm: removing an incomplete bundler download at $bundle"
  fi
  rm -rf "$bundle"
elif [ -e "$bundle" ]; then
  die "$bundle exists and is not a directory or link; remove it"
fi
ln -s "$prefix" "$bundle"
touch "$sentinel"

installed || die "installed, but the check after it fails (see $bundle)"
echo "install-llvm: LLVM $("$prefix/bin/llvm-config" --version) ready at $prefix (bundler dir $bundle)"
