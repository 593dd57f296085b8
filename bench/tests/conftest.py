"""The benches' tests use the suite's fixtures and hooks (tests/conftest.py: the tiny models, the launchers,
the `backend(name)` marker, the servers' logs in a failed test's report), imported here by name so that
pytest finds them for this directory too."""

from tests.conftest import (  # noqa: F401  (fixtures and hooks: pytest finds them by name)
    launcher,
    make_tiny_model,
    module_launcher,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    session_launcher,
    smollm2_dir,
    tiny_model_dir,
    tokenizer_dir,
)
