"""Language models: LoRA adapters and partly frozen models (adapters.py), chat, instruction and text data tokenized
(chat.py), generated samples (generation.py), and
`from_pretrained` folders with their tokenizer (pretrained.py).

May import: the base, data, workload, distributed.
"""
