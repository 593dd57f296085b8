#!/usr/bin/env bash
# Machine 10.0.0.5: the router, the only address clients need. It waits for every worker to be healthy;
# workers started later join with the admin key (read from its file, not typed on the command line):
#   curl -X POST http://$ROUTER_IP:$ROUTER_PORT/workers -H @<(printf 'Authorization: Bearer %s\n' \
#     "$(cat "$SECRETS_DIR/admin-api-key")") -H 'content-type: application/json' \
#     -d '{"url": "http://10.0.0.13:30000", "worker_type": "prefill", "bootstrap_port": 8998}'
set -euo pipefail
set -a; source "$(dirname "$0")/cluster.env"; set +a
# clients send the api-key; /workers needs the admin key; the node key goes to the nodes on every hop
exec pdserve router --pd-disaggregation --host "$ROUTER_IP" --port "$ROUTER_PORT" \
  --prefill "http://$PREFILL_A_IP:$NODE_PORT" "$BOOTSTRAP_PORT" \
  --prefill "http://$PREFILL_B_IP:$NODE_PORT" "$BOOTSTRAP_PORT" \
  --decode "http://$DECODE_A_IP:$NODE_PORT" \
  --policy cache_aware --worker-startup-timeout-secs 1800 \
  --api-key-file "$SECRETS_DIR/api-key" --admin-api-key-file "$SECRETS_DIR/admin-api-key" \
  --node-api-key-file "$SECRETS_DIR/node-api-key" --cluster-secret-file "$SECRETS_DIR/cluster-secret"
