"""Reading models: Hugging Face folders, GGUF files and dummy weights into names and tensors
(or quantized blocks) with the family's architecture config; the tokenizer and chat template."""
