"""Model families as symbolic programs that mirror the Hugging Face forward code line by line."""
