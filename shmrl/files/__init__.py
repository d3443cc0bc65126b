"""What a run keeps on disk: checkpoints, the log folder, metrics and recorded datasets."""
