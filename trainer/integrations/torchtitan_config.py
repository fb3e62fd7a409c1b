"""A torchtitan config registry: torchtitan's own llama3 debug model with Sentinel's checkpoint manager.

    torchrun --nproc-per-node N -m torchtitan.train \\
        --module trainer.integrations.torchtitan_config --config llama3_debugmodel_sentinel

(``scripts/torchtitan-gpu-check`` runs it on a GPU host.) Imports torchtitan's model registry only
when called: on a CPU-only host it needs triton (torchtitan's MoE kernels), which is not there.
"""

from __future__ import annotations

from typing import Any

from trainer.integrations.torchtitan import SentinelCheckpointManager


def llama3_debugmodel_sentinel() -> Any:
    """torchtitan's ``llama3_debugmodel`` (its tokenizer and c4_test data from a torchtitan checkout,
    ``--hf_assets_path``), its checkpoint manager replaced by Sentinel's, checkpointing enabled every
    5 steps with the full state at the last step."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.checkpoint = SentinelCheckpointManager.Config(enable=True, interval=5, last_save_model_only=False,
                                                         keep_latest_k=3, folder=config.checkpoint.folder)
    return config
