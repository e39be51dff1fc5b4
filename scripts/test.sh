#!/usr/bin/env bash
# The project's whole test suite, from a fresh machine: makes the Python
# virtual environment for the grpcio tests if it is missing, then runs the Rust
# tests (unit, integration over real gRPC, proptests) and the Python tests
# against the binary cargo just built.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
req=tests/python/requirements.txt
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! cmp -s "$req" "$venv/.requirements"; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req"
  cp "$req" "$venv/.requirements"
fi

cargo test --all-targets
cargo build --bin kvroute
"$venv/bin/python" -m pytest -q tests/python
