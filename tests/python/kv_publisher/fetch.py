"""Fetch an engine's published kv_events.py from its PyPI wheel (test only).

Runs `pip download --no-deps --only-binary=:all:` for one pinned engine
version into a cache directory, then extracts only the kv_events.py module.
Nothing fetched here is ever committed. Prints the extracted file's path.
"""

import argparse
import pathlib
import subprocess
import sys
import zipfile

MEMBERS = {
    "vllm": "vllm/distributed/kv_events.py",
    "sglang": "sglang/srt/disaggregation/kv_events.py",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=sorted(MEMBERS), required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--cache", required=True, help="wheel cache directory")
    ap.add_argument("--out", required=True, help="directory for kv_events.py")
    a = ap.parse_args()
    cache = pathlib.Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    prefix = f"{a.engine}-{a.version}"
    wheels = sorted(cache.glob(f"{prefix}-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--quiet", "-d", str(cache), f"{a.engine}=={a.version}"],
            check=True,
        )
        wheels = sorted(cache.glob(f"{prefix}-*.whl"))
    if not wheels:
        sys.exit(f"no wheel for {a.engine}=={a.version} in {cache}")
    out = pathlib.Path(a.out) / f"{a.engine}-{a.version}"
    out.mkdir(parents=True, exist_ok=True)
    target = out / "kv_events.py"
    with zipfile.ZipFile(wheels[0]) as z:
        target.write_bytes(z.read(MEMBERS[a.engine]))
    print(target)


if __name__ == "__main__":
    main()
