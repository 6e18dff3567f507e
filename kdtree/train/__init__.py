"""Training of the tiny model in torch (CPU): torch re-statements of the K2 target (k2_torch) and the
DFlash drafter (drafter_torch), the stdlib corpus (data), the loops (loop), export (export), the CLI
(run) and numpy-engine acceptance measurement (evaluate)."""
