"""What a run reports: metrics log and its exporters (TensorBoard, MLflow, Prometheus), FLOPs and MFU, the step's
profile summary (step_profile), reading metrics.jsonl back (records), plots."""
