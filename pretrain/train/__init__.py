"""The training loop and its components: preflight, batches, stability, metrics, trackers."""
