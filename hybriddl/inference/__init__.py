"""Using a trained run's model: `evaluate` on a labelled ImageFolder, `predict` on images.

Images go through the preprocessing training gave them (scaled and centre-cropped as the
data cache stores them, then normalised as BatchTransform does, without a flip), a batch
at a time, so a folder of any size is read with memory flat in its size.
"""
