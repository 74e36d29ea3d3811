#!/usr/bin/env bash
# Checksums of what `coli` computes on every committed fixture of a supported family, one line
# each: `<sha256>  <what>`. Recorded in server/tests/fixtures/logits.sha256 at the commit before
# the restructure of issue 14 (a family added later: when it first ran exactly), and recorded again
# when attention's softmax became `tensor::attention::softmax` (issue 18: its own exp and a 16-lane
# sum; every fixture and variant re-checked against transformers by the oracle test first);
# server/tests/logits_checksums.rs runs this script with the `coli` under test and compares, so a
# refactor that changes one bit of output fails.
#
#   bash scripts/logits-checksums.sh target/release/coli > server/tests/fixtures/logits.sha256
#
# Per fixture: `coli logits` over the prompt followed by the greedy tokens (memory-mapped, and
# streamed under a RAM budget for the MoE families), then the fixture converted to GGUF q8_0
# (`coli convert`: the file's bytes, and `coli logits` on it) for the families GGUF has.
set -euo pipefail
coli=$(realpath "$1")
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/engine/tests/fixtures"
work=$(mktemp -d)
export COLI_STATE_DIR="$work/state" COLI_CACHE_DIR="$work/cache" COLI_LOG=error
# The commands' progress lines go to a log, shown only if something fails.
exec 3>&2 2>"$work/stderr"
trap 'rc=$?; [ $rc = 0 ] || cat "$work/stderr" >&3; rm -rf "$work"' EXIT

fixtures=(llama mixtral olmoe qwen3_moe deepseek_v3 kimi_k25 glm4_moe glm_moe_dsa deepseek_v4 qwen3_next qwen3_5_moe kimi_linear glm5_next minimax_m2 gpt_oss inkling inkling2)
for v in variants/*/; do fixtures+=("${v%/}"); done

sum() { sha256sum | cut -d' ' -f1; }
# The hash of what a command prints; a failing command ends the script (an assignment's status
# is its command's, so `set -e` sees it, where `echo "$(…)"` would hash the empty output).
hash_of() { local h; h=$("$@" | sum); printf '%s' "$h"; }
for f in "${fixtures[@]}"; do
  tokens=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(",".join(map(str, r["prompt_ids"] + r["greedy_ids"])))' "$f/reference.json")
  h=$(hash_of "$coli" logits --model "$f" --mmap --tokens "$tokens"); echo "$h  logits $f"
  if [ "$f" != llama ]; then
    h=$(hash_of "$coli" logits --model "$f" --ram 64M --no-learn --tokens "$tokens")
    echo "$h  logits --ram 64M $f"
  fi
  case "$f" in
    # No GGUF layout here for these (llama.cpp has none for some; the hybrids' are not written yet).
    glm_moe_dsa|deepseek_v4|qwen3_next|qwen3_5_moe|kimi_linear|glm5_next|minimax_m2|gpt_oss|inkling|inkling2|variants/*) continue ;;
  esac
  gguf="$work/$(echo "$f" | tr / _).gguf"
  "$coli" convert --model "$f" --out "$gguf" --type q8_0 >/dev/null 2>&1
  echo "$(sum < "$gguf")  convert q8_0 $f"
  h=$(hash_of "$coli" logits --model "$gguf" --mmap --tokens "$tokens"); echo "$h  logits gguf q8_0 $f"
done
