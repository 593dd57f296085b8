#!/usr/bin/env bash
# Machine 10.0.0.21: decode node A. Its transfer engine receives KV pages from both prefill machines.
set -euo pipefail
set -a; source "$(dirname "$0")/cluster.env"; set +a
# --host: the address the other machines use; every listener binds it and nothing else (nixl too)
exec pdserve decode --model "$MODEL" --host "$DECODE_A_IP" --port "$NODE_PORT" \
  --transfer-backend "$TRANSFER_BACKEND" --disaggregation-ib-device "$IB_DEVICE" --tp "$TP" \
  --page-size "$PAGE_SIZE" --max-running-requests 128 \
  --cluster-secret-file "$SECRETS_DIR/cluster-secret" --node-api-key-file "$SECRETS_DIR/node-api-key"
