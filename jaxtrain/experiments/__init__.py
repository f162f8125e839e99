"""One file per model size; each defines ``config() -> jaxtrain.config.Config`` and runs directly."""
