"""GGUF files: the header read in pure Python, and the conversion to a Hugging Face directory."""
