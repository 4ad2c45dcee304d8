"""Image-text data for VLM training; ``shapes`` renders a synthetic, learnable set that needs no downloads."""
