"""`dflash bench` and `dflash profile`: the method registry, the interleaved runner with its
equality check, statistics, tables and plots, the step profile and cost curves, the machine
description written into every results file. May import dflash.backends, text and engine."""
