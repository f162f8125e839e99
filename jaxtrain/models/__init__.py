"""Model code only: Flax NNX modules whose parameters and activations carry logical axis names."""
