"""pretrain: an LLM pretraining toolkit on Hugging Face accelerate."""

__version__ = "0.2.0"
