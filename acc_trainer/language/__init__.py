"""Language models: LoRA adapters and partly frozen models (adapters.py), generated samples (generation.py), and
`from_pretrained` folders with their tokenizer (pretrained.py). Text data is tokenized where data lives (data/text.py),
with the tokenizer workload/components.py turns --tokenizer's name into.

May import: the base, data, workload, distributed.
"""
