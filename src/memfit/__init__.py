"""memfit: make large PyTorch models fit in GPU memory."""
__version__ = "0.1.0"
