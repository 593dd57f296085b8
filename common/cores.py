"""Core lists as flags spell them: "0-3,6" -> [0, 1, 2, 3, 6]."""

from __future__ import annotations


def parse_cores(spec: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6] (sorted, without repeats); ValueError naming the bad part."""
    cores: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cores.extend(range(lo, hi + 1))
            else:
                cores.append(int(part))
        except ValueError:
            raise ValueError(f"bad core range {part!r}") from None
    if not cores:
        raise ValueError(f"no cores in {spec!r}")
    return sorted(set(cores))
