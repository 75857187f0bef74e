#!/usr/bin/env bash
# Bounded coverage-guided fuzzing of every parser of files a user receives from elsewhere
# (fuzz/README.md lists the targets). Runs each target for SECONDS_PER_TARGET seconds
# (default 60) under libFuzzer, starting from its seed corpus and crash regressions, and
# fails if any target crashes, hangs (one input over 30 s of wall time, generous because the
# machine may be shared), or runs out of memory (2 GiB RSS, or one allocation over 256 MiB).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a C++ compiler (libFuzzer is built from
# source by the libfuzzer-sys crate). Works on stable Rust: `-s none` builds without a
# sanitizer, so cargo-fuzz passes no nightly-only flag. Coverage instrumentation, debug
# assertions and overflow checks stay on; a capped global allocator in every target
# (fuzz/harness/alloc_cap.rs) turns an allocation sized by the input into a crash.
#
# New corpus entries go to fuzz/target/corpus/<target>/ (not committed); a crash is saved
# under fuzz/artifacts/<target>/. To keep a finding as a regression, copy the artifact to
# fuzz/regressions/<target>/: the corpus tests (`cargo test`) replay it from then on.
# Replay one input: cargo fuzz run -s none <target> <file>.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-60}
shift || true
if ! [[ $secs =~ ^[0-9]+$ ]] || [ "$secs" -lt 1 ]; then
  echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]" >&2
  exit 2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "scripts/fuzz.sh needs cargo-fuzz: cargo install cargo-fuzz" >&2
  exit 2
fi

flags=(-s none --codegen-units 16)
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo fuzz list)
fi

# Parsers read their input from files; keep those writes in memory where possible.
if [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then
  export TMPDIR=/dev/shm
fi

dict_of() {
  case $1 in
    idx | idx_bin) echo fuzz/dict/idx.dict ;;
    data_manifest | checkpoint | state_json | mc_tasks | smoke_baseline) echo fuzz/dict/json.dict ;;
    config_toml | config_set) echo fuzz/dict/toml.dict ;;
    *) echo "fuzz/dict/$1.dict" ;;
  esac
}

cargo fuzz build "${flags[@]}"
mkdir -p fuzz/target/logs
failed=()
printf '%-16s %12s %8s %s\n' target executions seconds result > fuzz/target/logs/summary.txt
for t in "${targets[@]}"; do
  work=fuzz/target/corpus/$t
  mkdir -p "$work" "fuzz/corpus/$t" "fuzz/regressions/$t"
  args=(-max_total_time="$secs" -timeout=30 -rss_limit_mb=2048 -print_final_stats=1)
  dict=$(dict_of "$t")
  [ -f "$dict" ] && args+=(-dict="$dict")
  log=fuzz/target/logs/$t.log
  echo "== $t: ${secs}s"
  start=$(date +%s)
  if cargo fuzz run "${flags[@]}" "$t" "$work" "fuzz/corpus/$t" "fuzz/regressions/$t" -- "${args[@]}" >"$log" 2>&1; then
    result=ok
  else
    result=FAILED
    failed+=("$t")
    grep -E "ERROR|panicked|alloc_cap|Test unit written|timeout|out-of-memory" "$log" | head -20 >&2 || true
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
  printf '%-16s %12s %8s %s\n' "$t" "$execs" "$(($(date +%s) - start))" "$result" | tee -a fuzz/target/logs/summary.txt
done
echo "logs and summary: fuzz/target/logs/"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran ${secs}s each without a crash"
