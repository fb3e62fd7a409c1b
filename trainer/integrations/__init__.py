"""Sentinel for the trainers people run, through their own extension points.

* :mod:`trainer.integrations.lightning`: ``SentinelCallback`` for Lightning (``lightning`` or
  ``pytorch_lightning`` 2.x; NeMo's trainer is Lightning's), the whole Lightning checkpoint in a
  DCP snapshot.
* :mod:`trainer.integrations.guarded`: the guard step every integration makes (snapshot lines, leaving
  when drained).
* :mod:`trainer.integrations.progress`: the job's progress record (the JSON lines a drill reads),
  shared by the integrations.

Each module imports its trainer only when imported itself: ``import trainer`` never pulls Lightning
or TorchTitan in.
"""
