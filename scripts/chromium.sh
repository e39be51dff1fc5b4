# Sourced by scripts/test.sh: tests/python/test_web_view.py loads the web
# view in a real browser, Debian's Chromium (headless), and reads the page
# it rendered; install the package when it is missing.
if ! command -v chromium >/dev/null; then
  source "$(dirname "${BASH_SOURCE[0]}")/debian.sh"
  debian_install "chromium (Debian) for the web view's browser test" \
    --no-install-recommends chromium
fi
