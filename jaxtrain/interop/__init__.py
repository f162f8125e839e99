"""Model files of other ecosystems in and out: Hugging Face transformers (hf_*) and PEFT adapter directories (peft)."""
