#!/usr/bin/env bash
# The real-publisher test (crates/kvroute-tools/tests/it/engine_publishers.rs): vLLM's and SGLang's
# own kv_events.py publish into a running kvroute. scripts/test.sh runs it;
# run it alone with this script. It needs Python 3 with venv and access to
# PyPI: the pinned engine wheels are fetched with `pip download --no-deps`
# into $KVROUTE_WHEEL_CACHE (default ~/.cache/kvroute/engine-wheels, outside
# the repository; ~600 MB the first time, reused afterwards), and only their
# kv_events.py is extracted. Any missing prerequisite fails the test
# (KVROUTE_REQUIRE_PUBLISHERS=1); it never skips here.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
source scripts/nats.sh
export KVROUTE_PUBLISHER_PYTHON="$PWD/$venv/bin/python"
export KVROUTE_REQUIRE_PUBLISHERS=1
start=$SECONDS
# One case at a time: each one's timing (publish pacing, replay) is its own.
cargo test -p kvroute-tools --test it engine_publishers -- --test-threads=1 "$@"
echo "publisher test: $((SECONDS - start))s"
