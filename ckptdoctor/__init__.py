"""ckptdoctor: diagnose and repair Megatron-Core distributed checkpoints offline."""

__version__ = "0.1.0"
