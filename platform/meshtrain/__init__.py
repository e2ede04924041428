"""meshtrain: pretrain Llama-family models with FSDP2 (HSDP) on Ray clusters."""

__version__ = "0.1.0"
