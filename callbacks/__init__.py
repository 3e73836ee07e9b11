"""Lightning callbacks for studying depth routing, training speed and downstream scores, and for checkpointing and
resuming runs."""

from mhar_lightning.callbacks.checkpoint import FinalStepCheckpoint
from mhar_lightning.callbacks.depth_attention import DepthAttentionLogger
from mhar_lightning.callbacks.downstream import DownstreamTasks
from mhar_lightning.callbacks.head_disagreement import HeadDisagreementProbe
from mhar_lightning.callbacks.memory import PeakMemoryMonitor
from mhar_lightning.callbacks.model_summary import ParameterSummary
from mhar_lightning.callbacks.progress_bar import StepProgressBar
from mhar_lightning.callbacks.resumed_validation import ResumeDueValidation
from mhar_lightning.callbacks.run_summary import RunSummary
from mhar_lightning.callbacks.same_world_size import SameWorldSize
from mhar_lightning.callbacks.throughput import TokenThroughputMonitor

__all__ = [
    "DepthAttentionLogger",
    "DownstreamTasks",
    "FinalStepCheckpoint",
    "HeadDisagreementProbe",
    "ParameterSummary",
    "PeakMemoryMonitor",
    "ResumeDueValidation",
    "RunSummary",
    "SameWorldSize",
    "StepProgressBar",
    "TokenThroughputMonitor",
]
