#!/usr/bin/env bash
# Build every fuzz target once, then run each for SECONDS on a copy of its committed corpus
# (fuzz/corpus/<target>/, never modified) with its dictionary (fuzz/dict/<target>.dict).
#
#   fuzz/run.sh SECONDS [TARGET...]
#   fuzz/run.sh build        (only the build; CI starts it early, in the background)
#
# Limits: RSS 2048 MiB, a single allocation 1024 MiB (-malloc_limit_mb), 10 s per input.
# A crash, leak, timeout or limit hit fails the run: its input is copied to
# fuzz/artifacts/<target>/ and its path printed. Prints one line per target (executions,
# seconds, result) and exits 1 if any target failed. Needs nightly and cargo-fuzz
# (`cargo install cargo-fuzz --locked`). FUZZ_JOBS sets the build's jobs (default 2).
set -euo pipefail
cd "$(dirname "$0")"

secs="${1:?usage: fuzz/run.sh SECONDS|build [TARGET...]}"
shift
if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

triple="$(rustc +nightly -vV | sed -n 's/^host: //p')"
echo "== fuzz: building ${#targets[@]} targets"
build_start=$SECONDS
CARGO_BUILD_JOBS="${FUZZ_JOBS:-2}" cargo +nightly fuzz build --debug-assertions
echo "== fuzz: built in $((SECONDS - build_start)) s"
if [ "$secs" = build ]; then exit 0; fi

# Scratch files of the targets (and the corpus copies) on tmpfs when there is one.
base="${TMPDIR:-/tmp}"
if [ -d /dev/shm ] && [ -w /dev/shm ]; then base=/dev/shm; fi
work="$(mktemp -d "$base/colibri-fuzz.XXXXXX")"
trap 'rm -rf "$work"' EXIT

failed=()
summary=()
for t in "${targets[@]}"; do
  bin="target/$triple/release/$t"
  mkdir -p "$work/$t/corpus" "$work/$t/artifacts" "$work/$t/tmp"
  cp -r "corpus/$t/." "$work/$t/corpus/" 2>/dev/null || true
  dict=()
  if [ -f "dict/$t.dict" ]; then dict=("-dict=dict/$t.dict"); fi
  echo "== fuzz: $t for ${secs} s"
  start=$SECONDS
  set +e
  TMPDIR="$work/$t/tmp" "$bin" "$work/$t/corpus" "${dict[@]}" \
    -max_total_time="$secs" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10 \
    -print_final_stats=1 -artifact_prefix="$work/$t/artifacts/" >"$work/$t/log" 2>&1
  rc=$?
  set -e
  took=$((SECONDS - start))
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t/log" | tail -1)"
  if [ "$rc" -eq 0 ]; then
    summary+=("$(printf '%-14s %10s execs %5s s  ok' "$t" "${execs:-?}" "$took")")
  else
    tail -n 60 "$work/$t/log"
    mkdir -p "artifacts/$t"
    kept=""
    for a in "$work/$t/artifacts/"*; do
      [ -e "$a" ] || continue
      cp "$a" "artifacts/$t/"
      kept="$PWD/artifacts/$t/$(basename "$a")"
      echo "fuzz: $t failed (exit $rc): $kept"
    done
    [ -n "$kept" ] || echo "fuzz: $t failed (exit $rc) without an artifact"
    summary+=("$(printf '%-14s %10s execs %5s s  FAILED %s' "$t" "${execs:-?}" "$took" "$kept")")
    failed+=("$t")
  fi
done

echo "== fuzz: summary"
printf '%s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz: failed: ${failed[*]}" >&2
  exit 1
fi
