"""Sentinel: GPU failure prediction that snapshots the job and moves it to a spare node.

The daemon package never imports torch (see tests/test_no_torch.py); the trainer side lives in
the separate ``trainer`` package.
"""

__version__ = "0.1.0"
