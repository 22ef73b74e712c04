"""What a run folder becomes: `columns` (every record and summary column, declared once), `summary` (per-cell means
with bootstrap CIs, changes against full), `recommend` (the smallest cache within a drop), `gate` (a baseline and the
checks against it), `tables` (the terminal's), `plot` (figures), `latex`, `html_page` (the HTML report's building
blocks), `gallery` (samples a policy lost), `serving_report` (load cells: goodput, latency, sustained rates) and
`report` (one HTML page per run).

It reads run folders (kvbench/runs/run_folder.py) and imports nothing that runs a model."""
