"""The DFlash and DFlash2 drafters: model, frozen target head, training loss, export format and speculative
evaluation."""

from dflash_stream.drafter.dflash2 import DFlash2Drafter, build_drafter
from dflash_stream.drafter.evaluate import evaluate
from dflash_stream.drafter.export import (
    drafter_state,
    export_drafter,
    load_checkpoint_drafter,
    load_drafter,
    save_checkpoint_drafter,
)
from dflash_stream.drafter.head import TargetHead, load_target_head
from dflash_stream.drafter.loss import LossOutput, Objective, dflash_loss, expected_acceptance, sample_anchors
from dflash_stream.drafter.model import DFlashDrafter
from dflash_stream.drafter.spec import DrafterSpec, build_spec

__all__ = [
    "DFlash2Drafter",
    "DFlashDrafter",
    "DrafterSpec",
    "LossOutput",
    "Objective",
    "TargetHead",
    "build_drafter",
    "build_spec",
    "dflash_loss",
    "drafter_state",
    "evaluate",
    "expected_acceptance",
    "export_drafter",
    "load_checkpoint_drafter",
    "load_drafter",
    "load_target_head",
    "sample_anchors",
    "save_checkpoint_drafter",
]
