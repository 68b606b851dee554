"""The model: config, the Llama-family decoder, loading (Hugging Face folders, GGUF, named
models, the built-in demo) and its progress bars."""
