# Sourced by scripts/test.sh: tests/python/test_web_view.py loads the web
# view in a real browser, Debian's Chromium (headless), and reads the page
# it rendered; install the package when it is missing.
if ! command -v chromium >/dev/null; then
  echo "installing chromium (Debian) for the web view's browser test" >&2
  sudo=
  if [ "$(id -u)" != 0 ]; then
    sudo=sudo
  fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
fi
