"""Drop a package a wheel carries but pdserve never imports, so the GPU machine's carried wheels fit its
64 MiB budget (tree + carried folders): `python -m bench.gpu.slim_wheel WHEEL TOP [TOP ...]` rewrites WHEEL
in place without the entries under each top-level folder TOP, and without their lines in the wheel's
RECORD (pip installs what RECORD lists). nixl-cu13's wheel carries `nixl_ep_cu13`, NIXL's expert-parallel
library (about half of the wheel), built for other torch versions than the machine's; `make gpu-wheels`
drops it."""

from __future__ import annotations

import os
import sys
import zipfile


def slim(path: str, tops: list[str]) -> int:
    """Rewrite the wheel at `path` without the entries under `tops`; returns how many entries went."""
    dropped = 0
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            top = info.filename.split("/", 1)[0]
            if top in tops:
                dropped += 1
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if ln.split("/", 1)[0] not in tops).encode()
            dst.writestr(info, data)
    os.replace(tmp, path)
    return dropped


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m bench.gpu.slim_wheel WHEEL TOP [TOP ...]", file=sys.stderr)
        return 2
    n = slim(argv[0], argv[1:])
    print(f"{os.path.basename(argv[0])}: {n} entries under {', '.join(argv[1:])} dropped "
          f"({os.path.getsize(argv[0])} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
