"""The data: built-in datasets and the two data paths (datasets.py), a user's own datasets (user_data.py), the
kind of data a run has, decided once where the data is built (kinds.py: `Data.kind`), mixtures of several sets
sampled with weights (mixtures.py), the run's loaders (loaders.py), streams (streams.py), augmentation (augment.py),
packing (packing.py), samples that cannot be read (faults.py), and text as users bring it (chat, prompt/completion,
preference pairs, prompts) tokenized with the run's tokenizer, its labels and collates (text.py).

May import: the base (config, flags, patches, stopping).
"""
