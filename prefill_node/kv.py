"""The prefill node's bootstrap server, started by rank 0.

The bootstrap server runs in the scheduler process of rank 0, not in the HTTP front end: `common/`
(the front end) must not depend on `transfer/`, and the server then lives exactly as long as the
ranks it describes — when the scheduler dies the decode side stops finding it, which is the signal
it needs. Rank 0 binds the server before it builds its own manager; the other ranks' managers retry
their registration until the server answers.
"""

from __future__ import annotations

import logging

from transfer.bootstrap import BootstrapServer

logger = logging.getLogger("prefill")


def start_bootstrap_server(args) -> BootstrapServer:
    server = BootstrapServer(args.host, args.disaggregation_bootstrap_port)
    server.start()
    logger.info("bootstrap server on %s:%d", args.host, server.port)
    return server
