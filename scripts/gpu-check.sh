#!/usr/bin/env bash
# The one check to run on a lent NVIDIA machine (which has no Rust toolchain): the CUDA kernels
# against the CPU bit for bit (engine/tests/device.rs, whose cuda test then runs for real), and
# `coli logits --device cuda` against `--device cpu` byte for byte on the committed fixtures
# (memory-mapped; with a small --vram so that only some matrices sit on the GPU; and the GGUF
# q8_0 conversion for the families GGUF has, for the integer kernels).
#
# Two steps:
#   1. here, with the toolchain:   scripts/gpu-check.sh --prepare
#      builds the release `device` test binary and `coli`, and puts them, stripped, with the
#      fixtures' token lists into target/gpu-check/ (the one path to carry);
#   2. on the GPU machine:         scripts/gpu-check.sh            (run from the repository root)
#      writes every output, log and a summary to $OUT (default target/gpu-check/out) and exits
#      non-zero when anything differs or fails. Takes well under 5 minutes (about 150 `coli`
#      runs on tiny models, six at a time). With the device tool: carry ["target/gpu-check"],
#      command "bash scripts/gpu-check.sh", timeout_s 300.
# GPU_CHECK_KIT overrides the kit's directory (target/gpu-check).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kit="${GPU_CHECK_KIT:-$root/target/gpu-check}"

if [ "${1:-}" = --prepare ]; then
  set -e
  cd "$root"
  mkdir -p "$kit"
  echo "== building the device test binary (release)"
  bin=$(cargo test --release --locked -p colibri-engine --test device --no-run \
          --message-format json \
        | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "device" and m.get("executable"):
        print(m["executable"])')
  [ -n "$bin" ] || { echo "gpu-check: no device test binary built" >&2; exit 1; }
  echo "== building coli (release)"
  cargo build --release --locked -p colibri-server --bin coli
  cp "$bin" "$kit/device"
  cp target/release/coli "$kit/coli"
  strip "$kit/device" "$kit/coli" 2>/dev/null || true
  # The token lists (prompt then greedy tokens), so the GPU machine needs no python.
  (cd engine/tests/fixtures && for f in llama mixtral olmoe qwen3_moe deepseek_v3 kimi_k25 \
      glm4_moe glm_moe_dsa deepseek_v4 qwen3_next qwen3_5_moe kimi_linear glm5_next minimax_m2 \
      gpt_oss inkling inkling2 variants/*; do
    [ -f "$f/reference.json" ] || continue
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2] + "\t" + ",".join(map(str, r["prompt_ids"] + r["greedy_ids"])))' \
      "$f/reference.json" "$f"
  done) > "$kit/tokens.tsv"
  du -sh "$kit/device" "$kit/coli"
  kib=$(du -sk "$kit" | cut -f1)
  [ "$kib" -lt 60000 ] || echo "gpu-check: warning: $kit is ${kib} KiB; a device run carries at most 64 MiB" >&2
  echo "gpu-check: prepared $kit; carry target/gpu-check and run scripts/gpu-check.sh there"
  exit 0
fi

out="${OUT:-$kit/out}"
mkdir -p "$out"
for f in device coli tokens.tsv; do
  [ -e "$kit/$f" ] || { echo "gpu-check: $kit/$f is missing; run scripts/gpu-check.sh --prepare first" >&2; exit 2; }
done
summary="$out/summary.txt"
: > "$summary"
failures=0
say() { echo "$*" | tee -a "$summary"; }
fail() { failures=$((failures + 1)); say "FAIL $*"; }

{
  date -u
  nvidia-smi 2>&1 || echo "nvidia-smi: not found"
} > "$out/machine.txt"
say "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo unknown)"

# 1. The kernels against the CPU (COLI_REQUIRE_CUDA: an open that fails is a failure, not a skip).
say "== device test (cuda)"
if COLI_REQUIRE_CUDA=1 timeout 120 "$kit/device" cuda_products_have_the_cpu_bits --exact \
    --nocapture --test-threads 1 \
    > "$out/device-cuda.log" 2>&1; then
  say "ok   device test cuda_products_have_the_cpu_bits ($(grep -m1 'cuda device:' "$out/device-cuda.log"))"
else
  fail "device test cuda (see device-cuda.log):"
  tail -20 "$out/device-cuda.log" | tee -a "$summary"
fi
# The Vulkan test too, for information (it says skipped where the machine has no Vulkan loader).
timeout 60 "$kit/device" vulkan_products_have_the_cpu_bits --exact --nocapture --test-threads 1 > "$out/device-vulkan.log" 2>&1 \
  && say "ok   device test vulkan ($(grep -m1 -E 'vulkan device:|skipped' "$out/device-vulkan.log"))" \
  || say "note device test vulkan failed (see device-vulkan.log; not counted)"

# 2. Whole models: the logits on the GPU must be the CPU's bytes. Fixtures run six at a time
# (each `coli` opens the GPU and verifies its kernels); each writes its lines to a .result file.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export COLI_STATE_DIR="$work/state" COLI_CACHE_DIR="$work/cache" COLI_LOG="${COLI_LOG:-info}"
coli="$kit/coli"
mkdir -p "$out/logits/variants"
cd "$root/engine/tests/fixtures"
# compare NAME MODEL TOKENS DEVICES [EXTRA ARGS]: cpu, then each of DEVICES (`;`-separated).
compare() {
  local name=$1 model=$2 tokens=$3 devices=$4
  shift 4
  local base="$out/logits/$name"
  if ! timeout 60 "$coli" logits --model "$model" --tokens "$tokens" "$@" --device cpu \
      > "$base.cpu.json" 2> "$base.cpu.log"; then
    echo "FAIL $name: coli logits --device cpu (see logits/$name.cpu.log)"
    return
  fi
  local dev
  IFS=';' read -ra devs <<< "$devices"
  for dev in "${devs[@]}"; do
    local tag=${dev// /_}
    # shellcheck disable=SC2086
    if ! timeout 60 "$coli" logits --model "$model" --tokens "$tokens" "$@" --device $dev \
        > "$base.$tag.json" 2> "$base.$tag.log"; then
      echo "FAIL $name: coli logits --device $dev (see logits/$name.$tag.log)"
    elif cmp -s "$base.cpu.json" "$base.$tag.json"; then
      echo "ok   $name --device $dev: $(sha256sum < "$base.$tag.json" | cut -c1-16) = cpu"
    else
      echo "FAIL $name --device $dev differs from --device cpu: $(cmp "$base.cpu.json" "$base.$tag.json" | head -1)"
    fi
  done
}
# One fixture: memory-mapped on the GPU (and, for the families, with only some matrices there),
# then its GGUF q8_0 conversion where GGUF has the family.
fixture() {
  local f=$1 tokens=$2 devices="cuda;cuda --vram 256K"
  case "$f" in variants/*) devices="cuda" ;; esac
  compare "$f" "$f" "$tokens" "$devices" --mmap
  case "$f" in
    glm_moe_dsa|deepseek_v4|qwen3_next|qwen3_5_moe|kimi_linear|glm5_next|minimax_m2|gpt_oss|inkling|inkling2|variants/*) return ;;
  esac
  local gguf="$work/$f.gguf"
  if timeout 60 "$coli" convert --model "$f" --out "$gguf" --type q8_0 > "$out/logits/$f.convert.log" 2>&1; then
    compare "$f.gguf_q8_0" "$gguf" "$tokens" "$devices" --mmap
  else
    echo "FAIL $f: coli convert --type q8_0 (see logits/$f.convert.log)"
  fi
}
say "== coli logits, cuda against cpu"
names=()
while IFS=$'\t' read -r f tokens; do
  while [ "$(jobs -rp | wc -l)" -ge 6 ]; do wait -n; done
  fixture "$f" "$tokens" > "$out/logits/$f.result" 2>&1 &
  names+=("$f")
done < "$kit/tokens.tsv"
wait
for f in "${names[@]}"; do
  cat "$out/logits/$f.result" >> "$summary"
  n=$(grep -c '^FAIL' "$out/logits/$f.result")
  failures=$((failures + n))
  [ "$n" = 0 ] || grep '^FAIL' "$out/logits/$f.result"
done
say "logits: $(cat "$out"/logits/*.result "$out"/logits/variants/*.result 2>/dev/null | grep -c '^ok') identical, $(cat "$out"/logits/*.result "$out"/logits/variants/*.result 2>/dev/null | grep -c '^FAIL') failed (every line in summary.txt)"

say "== $failures failure(s)"
[ "$failures" = 0 ]
