"""What a run reports: metrics log and its exporters (TensorBoard, MLflow, Prometheus), FLOPs and MFU, plots."""
