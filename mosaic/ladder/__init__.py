"""`mosaic ladder`: design, run and fit a ladder of small training runs for the 4-D scaling law."""
