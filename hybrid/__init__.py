"""hybrid: Megatron-style tensor, sequence and pipeline parallelism registered with DeepSpeed."""

__version__ = "0.1.0"
