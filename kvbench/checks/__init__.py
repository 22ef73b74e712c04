"""What holds kvbench to its references: `suite` (`kvbench check` on the user's model, dtype and device: each check
one line, passed, failed or skipped), `generations` (`model.generate`'s greedy generation beside kvbench's),
`kept` (what a cache keeps, and how far two kept sets agree) and `tolerance` (how far two correct computations may
land when only their rounding differs).

It imports the engine, the policies and the run folder's environment facts; nothing of the analysis."""
