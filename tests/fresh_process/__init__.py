"""Tests that run a process of their own but start no server: a fresh Python interpreter (what a module
imports at start, what `--help` prints, a compile without the test process's settings) or the C compiler.
tests/unit's guard (tests/unit/conftest.py) keeps such tests out of tests/unit."""
