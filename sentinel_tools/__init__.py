"""Sentinel's tools, kept out of the daemon package: the end-to-end drills (local and Slurm), the
rule replay scenarios and the fleet simulators. ``sentinel run`` never imports this package; the
CLI loads each tool lazily for its own command (``sentinel drill``, ``sentinel simulate``)."""
