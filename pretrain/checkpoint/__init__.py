"""What a run leaves on disk and reads back: checkpoints, manifests, run folders, resharding."""
