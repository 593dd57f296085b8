"""Tests of the GPU engine that need a CUDA device (skipped, with the reason, where there is none)."""
