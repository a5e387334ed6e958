"""The model and what it costs: the GPT model, its FLOPs and the device's peak, activation recomputation."""
