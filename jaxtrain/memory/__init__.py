"""Memory techniques beyond sharding: host offload (offload), float16 loss scaling (loss_scale), int8 / fp8
quantized training (quant), gradient sums in bfloat16 (grad_comm), and on CPUs XLA:CPU's step buffers kept
mapped by malloc (host_malloc)."""
