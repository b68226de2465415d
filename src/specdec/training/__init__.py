"""Self-distillation data and training for draft heads (DESIGN.md §5)."""
