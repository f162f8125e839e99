"""YAML rule sets mapping logical axis names to mesh axes (data, fsdp, tensor); one file each."""
