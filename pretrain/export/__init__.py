"""Export to Hugging Face transformers: the verified conversion, the tokenizer, sampling from an export."""
