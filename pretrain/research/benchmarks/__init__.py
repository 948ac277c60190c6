"""Benchmarks (scripts, not timed tests): arms side by side (compare_arms), the Hadamard transform's
token chunks, nanoGPT's recipe beside ours. Dated runs: RESULTS.md."""
