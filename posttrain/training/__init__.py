"""Training: the trainers and what they share.

The online RL loop (:mod:`.online`) over its session (:mod:`.session`), the preference trainer
(:mod:`.preference`), the run around a loop (:mod:`.runner`: run directory, evaluation, logging,
checkpoints), the optimizer (:mod:`.optim`), checkpoints (:mod:`.checkpoint`), guards against silent
failures (:mod:`.guards`), ``posttrain eval`` (:mod:`.evaluation`) and the Python entry point
(:mod:`.api`).
"""
