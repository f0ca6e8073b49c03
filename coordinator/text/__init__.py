"""Text around the network: tokenizers (tokenizer.py; gguf_tokenizer.py builds one from a GGUF file's vocabulary),
chat templates rendered as transformers renders them (chat_template.py) and constrained decoding's grammars
(grammar.py, on llguidance). It imports no other coordinator package but errors.py."""
