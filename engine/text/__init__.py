"""Text: the tokenizer (tokenizer.json or a GGUF's metadata), chat templates, incremental
detokenizing and the piece memo."""
