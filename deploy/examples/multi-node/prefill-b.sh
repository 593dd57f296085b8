#!/usr/bin/env bash
# Machine 10.0.0.12: prefill node B (HTTP on NODE_PORT, bootstrap server on BOOTSTRAP_PORT).
set -euo pipefail
set -a; source "$(dirname "$0")/cluster.env"; set +a
# --host: the address the other machines use; every listener binds it and nothing else (nixl too)
exec pdserve prefill --model "$MODEL" --host "$PREFILL_B_IP" --port "$NODE_PORT" \
  --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" --transfer-backend "$TRANSFER_BACKEND" \
  --disaggregation-ib-device "$IB_DEVICE" --tp "$TP" --page-size "$PAGE_SIZE" \
  --cluster-secret-file "$SECRETS_DIR/cluster-secret" --node-api-key-file "$SECRETS_DIR/node-api-key"
