"""Head training: self-distilled data, losses, and the trainer."""
