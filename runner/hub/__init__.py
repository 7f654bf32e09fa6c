"""The Hugging Face hub: hf:// sources fetched into the cache, and exports published to it."""
