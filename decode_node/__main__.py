"""`python -m decode_node [ServerArgs flags]`: a decode node (same as `pdserve decode`)."""

import sys

from decode_node.launch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
