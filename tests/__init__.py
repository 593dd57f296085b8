"""pdserve's tests: a package, so test modules import their helpers as `tests.harness...`,
`tests.model_harness`, `tests.transfer.kv_harness` (pytest puts the repository root on sys.path)."""
