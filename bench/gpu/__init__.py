"""`pdserve bench gpu`: the GPU engine against the device's own copy bandwidth and matmul rate (`run.py`)."""
