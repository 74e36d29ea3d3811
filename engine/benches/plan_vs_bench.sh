#!/usr/bin/env bash
# Predicted (`coli plan --json`) against measured (`coli bench --json`) decode speed, as a
# markdown table: one row per model and RAM budget.
#
#   engine/benches/plan_vs_bench.sh -m MODEL [-m MODEL ...] -r BUDGET [-r BUDGET ...] [-- BENCH FLAGS]
#
# e.g. engine/benches/plan_vs_bench.sh -m ~/models/Qwen3-30B-A3B -r 8G -r 16G -- --gen-tokens 64
#
# COLI (default: target/release/coli, else `coli` on the PATH) is the binary run; REPS
# (default 1) bench runs per row, back to back, of which the median decode speed and its hit
# rate are shown (the machine is shared and noisy: see docs/benchmarks.md). Flags after
# `--` go to both commands when both take them (engine flags: --threads, --io, --mirror, ...;
# bench-only flags such as --gen-tokens are given to bench only). A budget of `mmap` plans and
# benches with --mmap instead of --ram. Each bench run records the usage history the next plan
# reads, so run the budgets in the order you want the history built (or with --no-learn).
set -euo pipefail

coli="${COLI:-}"
reps="${REPS:-1}"
if [[ -z "$coli" ]]; then
  if [[ -x target/release/coli ]]; then coli=target/release/coli; else coli=coli; fi
fi

models=() budgets=() extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -m|--model) models+=("$2"); shift 2 ;;
    -r|--ram) budgets+=("$2"); shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ ${#models[@]} -eq 0 || ${#budgets[@]} -eq 0 ]]; then
  echo "give at least one -m MODEL and one -r BUDGET (see --help)" >&2
  exit 2
fi

# Engine flags both commands take; the rest of `extra` goes to bench only.
plan_flags=() bench_flags=()
i=0
while [[ $i -lt ${#extra[@]} ]]; do
  a="${extra[$i]}"
  case "$a" in
    --gen-tokens|--prompt-tokens|--prefill-chunk|--draft-reps)
      bench_flags+=("$a" "${extra[$((i+1))]}"); i=$((i+2)) ;;
    --cold|--remeasure)
      bench_flags+=("$a"); i=$((i+1)) ;;
    --*=*) plan_flags+=("$a"); bench_flags+=("$a"); i=$((i+1)) ;;
    --*)
      if [[ $((i+1)) -lt ${#extra[@]} && "${extra[$((i+1))]}" != --* ]]; then
        plan_flags+=("$a" "${extra[$((i+1))]}"); bench_flags+=("$a" "${extra[$((i+1))]}"); i=$((i+2))
      else
        plan_flags+=("$a"); bench_flags+=("$a"); i=$((i+1))
      fi ;;
    *) echo "unexpected argument after --: $a" >&2; exit 2 ;;
  esac
done

field() { # JSON on stdin, a dotted path: its value
  python3 -c 'import json,sys
v=json.load(sys.stdin)
for k in sys.argv[1].split("."): v=v[k]
print(v)' "$1"
}

echo "| model | budget | predicted tok/s | measured tok/s | measured / predicted | predicted hit | measured hit |"
echo "|---|---|---:|---:|---:|---:|---:|"
for m in "${models[@]}"; do
  for b in "${budgets[@]}"; do
    if [[ "$b" == mmap ]]; then budget=(--mmap); else budget=(--ram "$b"); fi
    if ! plan=$("$coli" plan -m "$m" "${budget[@]}" ${plan_flags[@]+"${plan_flags[@]}"} --json 2>/dev/null); then
      echo "| $(basename "$m") | $b | refused | - | - | - | - |"
      continue
    fi
    runs=()
    for ((r = 0; r < reps; r++)); do
      bench=$("$coli" bench -m "$m" "${budget[@]}" ${bench_flags[@]+"${bench_flags[@]}"} --json)
      runs+=("$(field decode_tok_per_s <<<"$bench") $(field decode_byte_hit_rate <<<"$bench")")
    done
    p=$(field prediction.decode_tok_per_s <<<"$plan")
    ph=$(field prediction.ram_hit_fraction <<<"$plan")
    # The median run by decode speed, and its hit rate.
    read -r t th < <(printf '%s\n' "${runs[@]}" | sort -g | sed -n "$(( (${#runs[@]} + 1) / 2 ))p")
    python3 -c 'import sys
m,b,p,t,ph,th=sys.argv[1:]
p,t,ph,th=float(p),float(t),float(ph),float(th)
r=t/p if p>0 else float("nan")
print(f"| {m} | {b} | {p:.2f} | {t:.2f} | {r:.2f} | {ph*100:.1f} % | {th*100:.1f} % |")' \
      "$(basename "$m")" "$b" "$p" "$t" "$ph" "$th"
  done
done
