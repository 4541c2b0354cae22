"""Per model family knowledge: config adapter, parallel plan, weight mapping, HF class names."""
