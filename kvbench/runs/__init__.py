"""Running a grid's cells into a run folder: `run_folder` (manifest.json, records.jsonl, cells.jsonl: what every
later stage reads), `batching` (which samples run together), `runner` (one sample of a cell: its record),
`load_cell` (a load cell: its requests served, a record each), `outcomes` (where finished work goes), `sweep` (a
grid, one model at a time, sharing prompts), `work` (a sweep's work as estimates and executors see it) and
`ray_executor` (the same work on a Ray cluster).

It imports the config, the engine, the tasks and the service; nothing of the analysis after it."""
