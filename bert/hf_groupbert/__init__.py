"""GroupBERT as transformers remote code: `bert.py export-hf` copies configuration_groupbert.py
and modeling_groupbert.py beside the weights, and `AutoModel*.from_pretrained(DIR,
trust_remote_code=True)` runs them. They import only torch and transformers, never this
project, so nothing here imports them either.
"""
