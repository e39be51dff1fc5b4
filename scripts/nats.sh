# Sourced by scripts/test.sh and scripts/publisher-test.sh: the cluster-mode
# tests start their own nats-server (JetStream); install Debian's package
# when it is missing. A test that needs it fails without it, never skips.
if ! command -v nats-server >/dev/null; then
  echo "installing nats-server (Debian package) for the cluster-mode tests" >&2
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq nats-server
  else
    sudo apt-get update -qq && sudo apt-get install -y -qq nats-server
  fi
fi
