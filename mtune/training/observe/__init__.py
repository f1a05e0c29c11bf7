"""Watching a run: metric loggers (`metrics.jsonl`, TensorBoard, W&B), the step timer and plots, the progress
bar, the profiler, and the `TrainingMonitor` that ties them together once per step."""
