"""The statistics of pretraining sweeps: `python -m pretrain.research.report DIR… --out REPORT_DIR`.

runs.py finds the runs (experiment records) and measures each one, stats.py holds the tests,
tables.py and plots.py the outputs, build.py puts report.md together, __main__.py is the command.
"""
