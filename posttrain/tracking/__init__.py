"""Tracking: what a run records and how it is summarised.

The metrics and samples files of a run directory and the experiment trackers that also receive them
(:mod:`.metrics`), the curves drawn from those files (:mod:`.plots`), and the statistics of an
evaluation: confidence intervals, pass@k, maj@k (:mod:`.stats`). Imports nothing else of posttrain.
"""
