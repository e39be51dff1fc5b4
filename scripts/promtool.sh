# Sourced by scripts/test.sh: tests/python/test_observability.py checks the
# alert rules with promtool (`promtool check rules`, `promtool test rules`);
# install Debian's package prometheus, which ships it, when it is missing.
# Only the tool is wanted: no recommends (no node exporter), and where
# systemd started the Prometheus server the package brings, it is stopped
# and disabled again.
if ! command -v promtool >/dev/null; then
  source "$(dirname "${BASH_SOURCE[0]}")/debian.sh"
  debian_install "promtool (Debian package prometheus) for the alert rule tests" \
    --no-install-recommends prometheus
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    sudo=
    if [ "$(id -u)" != 0 ]; then
      sudo=sudo
    fi
    $sudo systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi
