#!/usr/bin/env bash
# Runs benchmarks.e2e.throughput jobs one after another in a new process session, so a queue longer than
# one device call (10 minutes there; one 128K configuration takes ~8-10 with its server start) outlives the
# call that started it: the device tool ends a call's processes when it returns, except a new session's.
#
#   bash benchmarks/e2e/queue.sh start DIR "--input-len 65536 --configs flashinfer-bf16" "--input-len 65536 --configs mpfa-qk4pv8"
#   bash benchmarks/e2e/queue.sh start DIR "-m benchmarks.e2e.serving --rates 0.25,0.4,0.55 --configs mpfa-qk4pv8"
#   bash benchmarks/e2e/queue.sh wait DIR SECONDS [DEST]   # until done or SECONDS; copies results + logs to DEST
#   bash benchmarks/e2e/queue.sh status DIR
#
# On a host of several GPUs, one queue per GPU, each with its own port, runs configurations side by side:
#   CUDA_VISIBLE_DEVICES=1 bash benchmarks/e2e/queue.sh start q1 "--input-len 65536 --configs mpfa-qk4pv8 --port 30612"
# then `python -m benchmarks.e2e.merge_results --publish q0/e2e_sglang_h200.json q1/e2e_sglang_h200.json` (here,
# after the files come back) folds them into benchmarks/results: refused for queues measured on another GPU than
# the published file names, and a merge with a failed row goes to benchmarks/results/scratch instead. The jobs
# themselves write only to DIR (never to benchmarks/results).
#
# A job is benchmarks.e2e.throughput's arguments, or "-m MODULE ARGS" for another runner that takes --out (the
# serving client: benchmarks.e2e.serving).
# DIR starts with a copy of benchmarks/results/e2e_sglang_h200.json (and serving_h200.json), so `--requests auto`
# sees the measured pools and DIR's files end as the whole results files (earlier rows + this queue's).
set -uo pipefail
cmd=${1:?start, wait or status}; dir=${2:?queue directory}
case "$cmd" in
  start)
    shift 2
    [ $# -gt 0 ] || { echo "queue.sh start: give at least one job (throughput arguments, or -m MODULE ARGS)" >&2; exit 2; }
    mkdir -p "$dir"
    cp benchmarks/results/e2e_sglang_h200.json benchmarks/results/serving_h200.json "$dir/" 2>/dev/null
    printf '%s\n' "$@" > "$dir/jobs"
    rm -f "$dir/done" "$dir/queue.log"
    setsid bash -c '
      dir=$1; n=0
      while IFS= read -r job; do
        n=$((n + 1)); echo "[$(date -u +%T)] job $n: $job" >> "$dir/queue.log"
        case "$job" in
          "-m "*) set -- $job; module=$2; shift 2; python3 -m "$module" "$@" --out "$dir" < /dev/null >> "$dir/queue.log" 2>&1 ;;
          *) python3 -m benchmarks.e2e.throughput $job --out "$dir" < /dev/null >> "$dir/queue.log" 2>&1 ;;
        esac
        rc=$?; echo "[$(date -u +%T)] job $n exit $rc" >> "$dir/queue.log"
      done < "$dir/jobs"
      touch "$dir/done"' _ "$dir" < /dev/null > /dev/null 2>&1 &
    echo "queue started: $(wc -l < "$dir/jobs") jobs, log $dir/queue.log"
    ;;
  wait)
    limit=${3:?seconds}; dest=${4:-}
    end=$((SECONDS + limit))
    while [ ! -f "$dir/done" ] && [ $SECONDS -lt $end ]; do sleep 10; done
    grep -E "^\[|output tok/s|req/s:|Error|error" "$dir/queue.log" | tail -20
    if [ -n "$dest" ]; then
      mkdir -p "$dest"
      cp "$dir"/e2e_sglang_h200.json "$dir"/serving_h200*.json "$dir"/serving_h200*.png "$dest/" 2>/dev/null
      tar czf "$dest/e2e-logs.tgz" -C "$dir" logs queue.log 2>/dev/null
    fi
    [ -f "$dir/done" ] && echo "queue done" || echo "queue still running"
    ;;
  status)
    tail -5 "$dir/queue.log"; [ -f "$dir/done" ] && echo "queue done" || echo "queue still running"
    ;;
  *) echo "queue.sh: unknown command $cmd (start, wait or status)" >&2; exit 2 ;;
esac
