"""leantune: fine-tune text-generation LLMs efficiently on the hardware you have."""

__version__ = "0.1.0"
