"""`python -m prefill_node [ServerArgs flags]`: a prefill node (same as `pdserve prefill`)."""

import sys

from prefill_node.launch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
