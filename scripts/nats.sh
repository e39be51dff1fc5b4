# Sourced by scripts/test.sh and scripts/publisher-test.sh: the cluster-mode
# tests start their own nats-server (JetStream); install Debian's package
# when it is missing. A test that needs it fails without it, never skips.
if ! command -v nats-server >/dev/null; then
  source "$(dirname "${BASH_SOURCE[0]}")/debian.sh"
  debian_install "nats-server (Debian package) for the cluster-mode tests" nats-server
fi
