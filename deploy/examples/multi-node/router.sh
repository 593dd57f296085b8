#!/usr/bin/env bash
# Machine 10.0.0.5: the router, the only address clients need. It waits for every worker to be healthy;
# workers started later join with: curl -X POST http://$ROUTER_IP:$ROUTER_PORT/workers \
#   -H 'content-type: application/json' \
#   -d '{"url": "http://10.0.0.13:30000", "worker_type": "prefill", "bootstrap_port": 8998}'
set -euo pipefail
set -a; source "$(dirname "$0")/cluster.env"; set +a
exec pdserve router --pd-disaggregation --host 0.0.0.0 --port "$ROUTER_PORT" \
  --prefill "http://$PREFILL_A_IP:$NODE_PORT" "$BOOTSTRAP_PORT" \
  --prefill "http://$PREFILL_B_IP:$NODE_PORT" "$BOOTSTRAP_PORT" \
  --decode "http://$DECODE_A_IP:$NODE_PORT" \
  --policy cache_aware --worker-startup-timeout-secs 1800
