"""Calibration: time the runnable backends of an op over a ladder of sizes on one card
and turn the measurement into a device-scoped, size-bucketed policy.

Measurement becomes preference, never requirement: what this writes is an ordinary
policy file, checked by the loader like any other. Imports torch only when inputs are
built (`inputs`), never at import.

Modules: `ladder` (sizes, profiles, which sizes run in CUDA graphs), `inputs` (the ops'
inputs at a size, checked against their references), `timing` (timers), `measure` (the
loop), `choose` (timings -> buckets, the noise band), `writer` (buckets -> a policy file).
"""
