"""The Hugging Face modules an exported bundle carries, copied there verbatim (no cflib imports)."""
