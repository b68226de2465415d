"""`specdec tune`, a tool: search.py measures and chooses, replay.py models greedy acceptance exactly,
cli.py is the command. The choice is stored through the core module specdec.tuning."""
