"""What an LLM serving engine (vLLM, SGLang, TGI) sets aside on each GPU, read from the model's config alone: its
weights as the engine stores them, the profile run's activations, the memory outside torch, CUDA graphs and the paged
KV cache the rest becomes. No torch: an answer in well under a second."""
