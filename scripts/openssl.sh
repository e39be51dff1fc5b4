# Sourced by scripts/test.sh: the TLS tests (tests/python/test_tls_auth.py)
# make their certificates with the openssl CLI at test time; install
# Debian's package when it is missing.
if ! command -v openssl >/dev/null; then
  source "$(dirname "${BASH_SOURCE[0]}")/debian.sh"
  debian_install "openssl (Debian package) for the TLS tests" openssl
fi
