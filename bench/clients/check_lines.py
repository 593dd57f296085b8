"""What the client check scripts (openai_checks.py, langchain_checks.py, litellm_checks.py) share: a check
is a function that returns its detail or raises `Failed`; `run_checks` prints one JSON line per check,
{"check": name, "ok": bool, "detail": str}, and returns the exit code (0 iff every check passed).

Standard library only: the scripts run with a client's venv, and find this module beside them (a script's
own folder is first on its `sys.path`).
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable


class Failed(Exception):
    """A check's expectation that did not hold; the message is its one-line reason."""


def expect(cond: bool, why: str) -> None:
    if not cond:
        raise Failed(why)


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options every check script takes: the server's OpenAI base URL, the model, a timeout."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--base-url", required=True, help="the server's OpenAI base URL, ending in /v1")
    p.add_argument("--model", default="default", help="the served model name")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    return p


def run_checks(checks: dict[str, Callable[[], str]],
               describe_error: Callable[[Exception], str | None] = None) -> int:
    """Run each check; `describe_error` may name a client's own error type in one line (None: the default)."""
    failed = 0
    for name, check in checks.items():
        try:
            ok, detail = True, check()
        except Failed as e:
            ok, detail = False, str(e)
        except Exception as e:  # the client's own error is this check's failure, in one line
            where = traceback.extract_tb(e.__traceback__)[-1]
            described = describe_error(e) if describe_error else None
            ok, detail = False, described or (f"{type(e).__name__}: {e} "
                                              f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})")
        failed += not ok
        print(json.dumps({"check": name, "ok": ok, "detail": detail.replace("\n", " ")[:400]}), flush=True)
    return 1 if failed else 0
