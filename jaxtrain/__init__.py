"""jaxtrain: a JAX training stack for large language models on device meshes."""
