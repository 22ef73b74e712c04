"""The sweep config, from its YAML files to the grid of cells: `files` (the files merged over their includes,
`--set` applied, where each key was given), `schema` (the validated `SweepConfig`: every error names the file, line
and key) and `cells` (the grid: one cell per point, its id a hash of what it runs).

It imports the engine's settings and estimates, the policy and task registries (to check a name and its parameters)
and the service's trace reader; nothing that runs a cell."""
