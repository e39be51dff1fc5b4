# Sourced by scripts/test.sh: the TLS tests (tests/python/test_tls_auth.py)
# make their certificates with the openssl CLI at test time; install
# Debian's package when it is missing.
if ! command -v openssl >/dev/null; then
  echo "installing openssl (Debian package) for the TLS tests" >&2
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq openssl
  else
    sudo apt-get update -qq && sudo apt-get install -y -qq openssl
  fi
fi
