"""Integrations with the Hugging Face ecosystem (accelerate)."""
