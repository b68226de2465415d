"""Self-distillation data and training for draft heads (docs/design.md, "Training data")."""
