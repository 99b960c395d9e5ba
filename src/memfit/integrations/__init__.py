"""memfit inside the user's framework: callbacks that predict the trainer's step before it runs and measure it.

    from memfit.integrations.transformers import MemfitCallback   # Hugging Face Trainer
    from memfit.integrations.lightning import MemfitCallback      # lightning.pytorch or pytorch_lightning
"""
