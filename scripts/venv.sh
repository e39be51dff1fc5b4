# Sourced by scripts/test.sh and scripts/publisher-test.sh: makes the
# project's Python virtual environment (.venv) if it is missing and installs
# tests/python/requirements.txt into it when that file changed.
venv=.venv
req=tests/python/requirements.txt
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! cmp -s "$req" "$venv/.requirements"; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req"
  cp "$req" "$venv/.requirements"
fi
