"""The checkpoint manager robust.checkpoint_format names: "dcp" (checkpoint_dcp.py, the default) or
"snapshot" (checkpoint.py). Its own module so that the two managers import one way (the DCP manager
uses checkpoint.py's listing and manifest; neither imports the other's manager)."""

from __future__ import annotations

import torch

from megascope.trainer.config import JobConfig
from megascope.trainer.parallel.parallel_dims import ParallelDims
from megascope.trainer.robust.checkpoint import CheckpointManager
from megascope.trainer.robust.checkpoint_dcp import DcpCheckpointManager


def make_checkpoint_manager(cfg: JobConfig, dims: ParallelDims, rank: int,
                            device: torch.device) -> CheckpointManager | DcpCheckpointManager:
    """Both managers have the same interface: save, close, resume, stalls_s, write_s, errors."""
    if getattr(cfg.robust, "checkpoint_format", "snapshot") == "dcp":
        return DcpCheckpointManager(cfg, dims, rank, device)
    return CheckpointManager(cfg, dims, rank, device)
