# Sourced by the scripts that install a test's tool from Debian when it is
# missing (nats.sh, openssl.sh, promtool.sh, chromium.sh): one way to say
# why, and to run apt as root or through sudo.

# debian_install WHY [APT-GET INSTALL ARGS...]: installs quietly, saying WHY.
debian_install() {
  local why=$1
  shift
  echo "installing $why" >&2
  local sudo=
  if [ "$(id -u)" != 0 ]; then
    sudo=sudo
  fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}
