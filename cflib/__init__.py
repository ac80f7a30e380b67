"""cflib: efficient full-parameter SFT of TR-MoE language models."""
__version__ = "0.1.0"
