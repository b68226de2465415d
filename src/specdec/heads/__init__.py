"""Draft heads that read the target's features (EAGLE), and the trained heads shipped with the package."""
