#!/usr/bin/env bash
# Machine 10.0.0.21: decode node A. Its transfer engine receives KV pages from both prefill machines.
set -euo pipefail
set -a; source "$(dirname "$0")/cluster.env"; set +a
exec pdserve decode --model "$MODEL" --host 0.0.0.0 --port "$NODE_PORT" \
  --transfer-backend "$TRANSFER_BACKEND" --disaggregation-ib-device "$IB_DEVICE" --tp "$TP" \
  --page-size "$PAGE_SIZE" --max-running-requests 128
