"""Algorithms: every method of the lineage as a preset of named pieces, and the registries of those pieces.

A preset (:mod:`.presets`) is a frozen record: which advantage estimator, ratio, clip scheme,
aggregation, KL and filters an online method uses, or which loss and coefficients a preference
method uses. The math is in :mod:`posttrain.functional`; this layer only chooses and configures it.
:mod:`.tables` renders the presets for ``posttrain algorithms``. Imports only ``functional``.
"""
