"""Report: several runs side by side.

``posttrain compare`` runs presets on one task and budget over seeds (:mod:`.compare`);
``posttrain report`` turns run directories into figures and one HTML page (:mod:`.build`, with its
HTML pieces in :mod:`.html`). The top layer under the CLI: it may start training runs.
"""
