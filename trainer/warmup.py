"""Imported once in the agent's forkserver (``python -m trainer.elastic``): what a PyTorch worker
imports lazily on its first model, first FSDP2 ``fully_shard``, first DCP save/load and first
step. ``import torch`` alone leaves most of it out — ``torch._dynamo`` (pulled in by FSDP2 and
the optimizers on first use: ~100 modules), DTensor, DCP and its storage layer — and a worker
forked from a forkserver that preloaded only ``torch`` spent 2-3 s of a loaded 2-core host
importing them between its process group and its first step. Import-only: no process group,
no CUDA initialisation, no threads (forking this process must stay safe).

``bench/migration.py`` and ``tests/test_elastic.py`` check that a worker forked after this
imports nothing heavy before its first step.
"""

from __future__ import annotations

import importlib

MODULES = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.checkpoint.staging",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._fsspec_filesystem",  # fsspec, when installed
    "torch.profiler",
    "torch.utils.serialization",
    "torch.nn.functional",
    "torch.optim",
    "numpy.random",
)

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except ImportError:  # an optional part missing here: the worker imports (or lacks) it as before
        pass
