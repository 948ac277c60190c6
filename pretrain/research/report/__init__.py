"""The statistics of pretraining sweeps: `python -m pretrain.research.report DIR… --out REPORT_DIR`.

runs.py finds the runs (experiment records), measures each one and reads its evaluations, stats.py
holds the tests, tables.py (Markdown, CSV, JSON), latex.py and plots.py the outputs, sweep_tables.py the
report's tables, gaps.py a spec's gaps by shape, sources.py the losses per data source, build.py puts
report.md together, __main__.py is the command.
"""
