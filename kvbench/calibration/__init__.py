"""What a calibrated policy reads, computed from the user's model: `methods` (what `kvbench calibrate` offers and
at what size), `artifacts` (the folder in kvpress's layout with kvbench's provenance), `kvzap` (KVzap's surrogate
models and their training on KVzip+ scores) and `calibrate` (each method, run and cached per model).

It sits with the policies it serves: they read its artifacts, and KVzap's training scores with KVzip+."""
