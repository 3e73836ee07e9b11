"""Lightning callbacks for studying depth routing and training speed."""

from mhar_lightning.callbacks.depth_attention import DepthAttentionLogger
from mhar_lightning.callbacks.head_disagreement import HeadDisagreementProbe
from mhar_lightning.callbacks.memory import PeakMemoryMonitor
from mhar_lightning.callbacks.throughput import TokenThroughputMonitor

__all__ = ["DepthAttentionLogger", "HeadDisagreementProbe", "PeakMemoryMonitor", "TokenThroughputMonitor"]
