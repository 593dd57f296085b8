"""The PD role layer: what the prefill role (prefill_node/) and the decode role (decode_node/) share.

It sits between the roles and the transfer layer: the roles import it, it imports transfer/ and
common/, and neither of those imports it back (tests/fresh_process/test_server_imports.py checks).

* `requests.py`: a request's PD state (`PDRequest`), the queue of one stage (`StageQueue`) and the
  limits a PD request keeps (its room, the first token's top logprobs);
* `role.py`: `PDRole`, the scheduler hooks both roles build on: the rendezvous check, one TP-wide
  poll of the transfers, failing and releasing a transfer, and `guarded` steps;
* `stats.py`: the transfer counters every PD node reports (`TransferStats`);
* `kv.py`: the rank's KV manager over the runner's pools (`build_kv_manager`, given the role's
  manager class), its transfer settings and the address peers reach it at.
"""
