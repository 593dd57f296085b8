"""Helpers every part of the suite shares (the fixtures over them are in tests/conftest.py):

* `tests.harness.nodes` — the servers and clusters of deploy/ (`ServerProcess`, `NodeProcess`, `RoleNode`,
  `RouterProcess`, the `Cluster` as `RouterCluster`) as the tests start them, `PDPair` (a prefill and a
  decode node the test dispatches to itself), and `Launcher`, which starts any of them and stops them all
* `tests.harness.client` — free ports, HTTP calls, SSE streams, Prometheus counters, `wait_until`
* `tests.harness.pd` — the PD node tests' settings, prompts, reference answers and free-resource checks
* `tests.harness.cluster` — the integration clusters' settings and per-node pool snapshots
* `tests.harness.backends` — which transfer backends can run here (`backend_params`, the backend marker)
"""
