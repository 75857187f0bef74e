#!/usr/bin/env bash
# kiln launch's control plane on a simulated job of many nodes, on one machine (issue #58).
#
#   bench/launch/scale.sh --nodes N --ranks-per-node M [--fault stop|kill|agent|straggler]
#                         [--plane tcp|files] [--count-ops] [--step-s S] [--warmup-s S]
#       one run: kiln's real supervisor, N node processes (each its own KILN_HOST, running the
#       real node agent under --plane tcp) with M simulated ranks each; one fault after the
#       warm-up; prints one JSON line: detect_s, culprit_ok, supervisor_cpu (cores, steady
#       state), peak_rss_mib, and with --count-ops run_dir_ops_per_s (strace; every process
#       up to 16 nodes, the supervisor alone beyond: under tcp the nodes write only to
#       /dev/shm).
#   bench/launch/scale.sh --table
#       the grid of bench/launch/results.md (1, 16, 64, 256 nodes x 12 ranks, both planes),
#       JSON lines to bench/launch/scale-results.jsonl and a markdown table on stdout.
#
# 256 agents on one machine need more inotify instances than the 128 a user gets by default
# (on a cluster each node has its own agent and its own limit); as root the script raises
# fs.inotify.max_user_instances, else the agents past the limit list their directory every
# 50 ms instead (they say so).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -q -p kiln-launch --bin kiln-plane-sim
SIM=target/release/kiln-plane-sim

limit=/proc/sys/fs/inotify/max_user_instances
if [ -w "$limit" ] && [ "$(cat "$limit")" -lt 1024 ]; then
  echo 1024 > "$limit"
fi

if [ "${1:-}" != "--table" ]; then
  exec "$SIM" scale "$@"
fi

out=bench/launch/scale-results.jsonl
: > "$out"
run() { "$SIM" scale --ranks-per-node 12 "$@" 2>/dev/null | tee -a "$out"; }
for n in 1 16 64 256; do
  for f in stop kill agent; do run --nodes "$n" --fault "$f" --plane tcp; done
  run --nodes "$n" --fault stop --plane tcp --count-ops
  # The files plane's ranks poll the run directory every 25 ms each: past 16 nodes (192
  # ranks) that alone saturates a 2-core machine, and its figures mean nothing.
  if [ "$n" -le 16 ]; then
    run --nodes "$n" --fault stop --plane files
    run --nodes "$n" --fault stop --plane files --count-ops
  fi
done
run --nodes 16 --fault straggler --plane tcp --step-s 0.25
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| plane | nodes | ranks | fault | detect_s | culprit | supervisor CPU (cores) | peak RSS MiB | run-dir ops/s (who) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    ops = r.get("run_dir_ops_per_s")
    sup = r.get("supervisor_run_dir_ops_per_s")
    who = "-" if sup is None else (f"{ops:.0f} (every process)" if ops is not None else f"{sup:.0f} (supervisor; nodes write /dev/shm)")
    print(f"| {r['plane']} | {r['nodes']} | {r['ranks']} | {r['fault']} | {r['detect_s']:.2f} | "
          f"{'ok' if r['culprit_ok'] else 'WRONG'} | {r['supervisor_cpu']:.3f} | {r['peak_rss_mib']:.1f} | {who} |")
PY
