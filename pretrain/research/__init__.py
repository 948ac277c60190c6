"""The study's tools: seeded sweeps, the statistical report, the memory plan and the benchmarks."""
