"""Benchmarks (scripts, not timed tests): arms side by side (compare_arms), the Hadamard transform's
token chunks, nanoGPT's recipe beside ours. Current figures and their commands: RESULTS.md."""
