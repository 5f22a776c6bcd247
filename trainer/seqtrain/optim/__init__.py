"""Optimizers (AdamW, LAMB, LARS, Adafactor, SGD) with their parameter groups and learning-rate schedules."""
