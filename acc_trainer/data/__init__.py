"""The data: built-in datasets and the two data paths (datasets.py), a user's own datasets (user_data.py), the
kind of data a run has, decided once where the data is built (kinds.py: `Data.kind`), the run's loaders (loaders.py),
streams (streams.py), augmentation (augment.py), packing (packing.py), and samples that cannot be read (faults.py).

May import: the base (config, flags, patches, stopping).
"""
