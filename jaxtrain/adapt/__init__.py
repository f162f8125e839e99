"""Adapting a base model: the frozen/trained split of the parameters and the base record (adapters), LoRA runs and
adapter files (lora)."""
